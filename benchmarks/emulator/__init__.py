"""Engine emulator: calibrated OpenAI-compatible engines, dozens in one process."""
