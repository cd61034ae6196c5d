"""Test and benchmark helpers, never used at serving time.

- :mod:`.models`: deterministic random-weight Llama checkpoints and tokenizers;
  :mod:`.hybrid_models`: tiny sliding-window, short-conv, Mamba2 and MLA checkpoints;
  :mod:`.adapters`: random LoRA adapters for those models, in PEFT's format.
- :mod:`.servers`: start, query and stop real vLLM OpenAI servers; :mod:`.zygote`: a
  process that has imported vLLM's API server once, to fork a session's servers from;
  :mod:`.vllm_forking`: that server with its EngineCore and workers forked, not spawned.
- :mod:`.netns`: a private loopback-only network namespace for servers that bind every
  interface (Mooncake on one machine).
- :mod:`.signals`: a SIGSTOP that returns once every thread of its target has stopped.
"""
