"""The SGLang-facing side: the plugin entry point, the scheduler hooks, metrics, the server process."""
