"""The demo and what it stands on: ``zoo`` (HF / timm / nanoGPT models from small configs and the CLI's model specs),
``corpus`` (the stdlib text corpus), ``train`` (train and time variants side by side) and ``run`` (``depthrewrite
demo``: convert, check, train, report). ``run`` loads on first use (``depthrewrite.api`` imports ``zoo``)."""

__all__ = ["DEMO_SCHEMES", "DemoConfig", "run_demo", "results_table", "timing_note"]


def __getattr__(name: str):
    if name in __all__:
        from . import run

        return getattr(run, name)
    raise AttributeError(f"module 'depthrewrite.demo' has no attribute {name!r}")
