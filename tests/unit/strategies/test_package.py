"""The registered strategies (``xtrainer/strategies/__init__.py``): names and instances."""

from xtrainer.strategies import STRATEGIES, Strategy, XlaNative, resolve_strategy


def test_strategy_registry():
    assert isinstance(resolve_strategy("xla_native"), XlaNative)
    custom = XlaNative()
    assert resolve_strategy(custom) is custom
    assert all(issubclass(cls, Strategy) and cls.name == name for name, cls in STRATEGIES.items())
