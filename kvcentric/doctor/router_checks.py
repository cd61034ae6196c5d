"""The router's config: the files it names, read as the router reads them, and its
engines: reachable, same model, same keys."""

from __future__ import annotations

from typing import Any

from kvcentric.doctor.findings import FAIL, OK, Finding
from kvcentric.doctor.layout import EngineInfo, ProbeResult, engine_info
from kvcentric.stored_layout import stored_block_size


def load_router(path: str) -> tuple[Any, Finding]:
    from kvcentric.router.config import load_config

    try:
        cfg = load_config(path)
    except (ValueError, OSError) as exc:
        return None, Finding("router-config", FAIL, f"{path}: {exc}",
                             "fix the router config (kvcentric-router init writes a minimal, "
                             "commented one)")
    return cfg, Finding("router-config", OK, f"{path}: model {cfg.model!r}, "
                        f"{len(cfg.instances)} instances")


TOKENIZER_FIX = ("set tokenizer to a local model folder (Hugging Face layout: tokenizer.json "
                 "or tokenizer_config.json, and config.json), e.g. the folder the engine "
                 "loads; relative paths are read from the directory the router starts in")


def check_router_files(cfg: Any) -> list[Finding]:
    """Every file and folder the router config names, read as the router reads them at
    start (relative to the working directory, as the router's are): the ``tokenizer``
    folder (the tokenizer and chat template; ``config.json``, which sizes the KV cache
    unless ``cost.kv_bytes_per_token`` is set), ``cost.profile``. (``auth.salt_secret_file``
    is read when the config loads; the store's paths are the store checks'.)"""
    from pathlib import Path

    from kvcentric.router.cost.cost_model import Profile, kv_bytes_per_token
    from kvcentric.router.tokenize import PromptTokenizer

    out = []
    folder = Path(cfg.tokenizer)
    if not folder.is_dir():
        why = "does not exist" if not folder.exists() else "is not a folder"
        out.append(Finding("router-tokenizer", FAIL, f"tokenizer {cfg.tokenizer!r} {why} "
                           f"(from {Path.cwd()}); the router reads only a local model folder, "
                           "never a hub id", TOKENIZER_FIX))
    else:
        try:
            tok = PromptTokenizer(folder)
        except ValueError as exc:
            out.append(Finding("router-tokenizer", FAIL, str(exc), TOKENIZER_FIX))
        else:
            template = "a chat template" if getattr(tok.tok, "chat_template", None) else (
                "no chat template (/v1/chat/completions will be refused)")
            out.append(Finding("router-tokenizer", OK, f"tokenizer {cfg.tokenizer}: "
                               f"{tok.vocab_size} tokens, {template}"))
        if not cfg.cost.kv_bytes_per_token:
            try:
                kvb = kv_bytes_per_token(folder, cfg.cost.kv_dtype)
            except (ValueError, KeyError, TypeError) as exc:
                why = (f"{folder / 'config.json'} has no {exc}" if isinstance(exc, KeyError)
                       else str(exc))
                out.append(Finding("router-model-config", FAIL, why,
                                   f"put the model's config.json in {cfg.tokenizer} (the "
                                   "router sizes the KV cache from it) or set "
                                   "cost.kv_bytes_per_token"))
            else:
                out.append(Finding("router-model-config", OK, f"{folder / 'config.json'}: "
                                   f"{kvb} KV bytes per token"))
    if cfg.cost.profile:
        try:
            Profile.load(cfg.cost.profile)
        except (ValueError, TypeError) as exc:
            out.append(Finding("router-profile", FAIL, f"cost.profile: {exc}",
                               "write one with kvcentric-router profile --url ENGINE --model "
                               "NAME --out FILE, or remove cost.profile (default costs)"))
        else:
            out.append(Finding("router-profile", OK, f"cost.profile {cfg.cost.profile}"))
    return out


def _router_block(cfg: Any, page: int | None) -> int | None:
    if page is None:
        return cfg.keys.block_size  # type: ignore[no-any-return]
    return stored_block_size(page, cfg.keys.block_size)


def _instance_problems(cfg: Any, info: EngineInfo, probe: ProbeResult | None) -> list[str]:
    problems = []
    if cfg.model not in info.models:
        problems.append(f"serves {list(info.models)}, the router routes model "
                        f"{cfg.model!r} (requests would fail or never match)")
    try:
        block = _router_block(cfg, info.page_size)
    except ValueError as exc:
        return problems + [str(exc)]
    if probe is not None and probe.url == info.url:
        if block is not None and block != probe.block_size:
            problems.append(f"stores {probe.block_size}-token blocks, the router hashes "
                            f"{block}-token blocks (set keys.block_size: {probe.block_size})")
        if probe.model_id != cfg.model_id:
            problems.append(f"keys its blocks under model id {probe.model_id!r}, the "
                            f"router under {cfg.model_id!r} (set keys.model_id)")
        if cfg.keys.layout_sig and cfg.keys.layout_sig != probe.layout_sig:
            problems.append(f"writes layout {probe.layout_sig}, the router pins "
                            f"keys.layout_sig {cfg.keys.layout_sig}")
    return problems


def check_router(cfg: Any, probe: ProbeResult | None) -> list[Finding]:
    """One finding per instance of the router config: reachable, same model, same keys."""
    import httpx  # the router extra's, as is the router this config is for

    out = []
    blocks = set()
    for inst in cfg.instances:
        try:
            info = engine_info(inst.url)
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            out.append(Finding("router-instance", FAIL, f"{inst.name} ({inst.url}) does not "
                               f"answer: {exc}", "fix the instance url or start the engine"))
            continue
        problems = _instance_problems(cfg, info, probe)
        if info.page_size:
            blocks.add(stored_block_size(info.page_size, None) if cfg.keys.block_size is None
                       else cfg.keys.block_size)
        details = {"url": inst.url, "models": list(info.models), "page_size": info.page_size}
        if problems:
            out.append(Finding("router-instance", FAIL, f"{inst.name}: " + "; ".join(problems),
                               "make the router config and the engines agree", details))
        else:
            out.append(Finding("router-instance", OK, f"{inst.name} serves {cfg.model!r}, "
                               f"page {info.page_size}", details=details))
    if len(blocks) > 1:
        out.append(Finding("router-instance", FAIL, f"engines of different page sizes give "
                           f"block sizes {sorted(blocks)}; the router uses one",
                           "pin keys.block_size (and the connectors' block_size)"))
    return out
