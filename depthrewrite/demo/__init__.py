"""The demo: ``corpus`` (the stdlib text corpus), ``train`` (train and time variants side by side) and ``run``
(``depthrewrite demo``: convert, check, train, report; it loads on first use). The models it trains come from
:mod:`depthrewrite.zoo` (also importable as ``depthrewrite.demo.zoo``)."""

__all__ = ["DEMO_SCHEMES", "DemoConfig", "run_demo", "results_table", "timing_note"]


def __getattr__(name: str):
    if name in __all__:
        from . import run

        return getattr(run, name)
    raise AttributeError(f"module 'depthrewrite.demo' has no attribute {name!r}")
