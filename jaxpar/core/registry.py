"""One registry type for every config key that names an entry (the schedules, context strategies,
recipes, optimizers, learning-rate schedules, remat policies, kernels and family configs), each a
`Registry` made and filled by the module that implements its entries.

Core cannot import those modules, so each registry files itself here under its key as it is made
(jaxpar's package imports them all before any config is read), and the config's checks ask every
one: a bad name fails where a bad number fails, in one line naming the choices. `one_of` refuses
a value of a key whose choices are a fixed tuple.
"""

from collections.abc import Callable, Iterable

from jaxpar.core.errors import UserError

REGISTRIES: dict[str, "Registry"] = {}  # config key -> its registry, in the order they were made


def one_of(key: str, value, choices: Iterable[str]) -> None:
    """Refuse `value` of `key` unless it is one of `choices`, in one line naming them."""
    choices = tuple(choices)
    if value not in choices:
        raise UserError(f"{key} must be one of {', '.join(choices)}, got '{value}'")


class Registry(dict):
    """The entries one config key names, by name. `default`: the entry an empty value means (None:
    an empty value is refused). `also`: values it takes besides its entries, listed first (the
    kernel keys' `auto`). `needs(cfg)`: what the config alone rules out for the named entry."""

    def __init__(self, key: str, entries: dict, *, default: str | None = None, also: tuple[str, ...] = (),
                 needs: Callable | None = None):
        super().__init__(entries)
        self.key, self.default, self.also, self.needs = key, default, also, needs
        REGISTRIES[key] = self

    @property
    def names(self) -> tuple[str, ...]:
        """Every value the key takes."""
        return (*self.also, *self)

    def check(self, value) -> None:
        """Refuse a value that names nothing here, in one line naming the choices."""
        if value or self.default is None:  # empty: the default
            one_of(self.key, value, self.names)

    def named(self, name: str):
        """The entry named `name`, refused in one line where none is: for a name that no config's
        checks have asked (a command's own flag, a test's)."""
        self.check(name)
        return self[name]

    def __missing__(self, name: str):
        """registry[""]: the default's entry. A config's names are checked as it loads, so past that
        code indexes the registry: each name is resolved once, where it is used."""
        if name or self.default is None:
            raise KeyError(name)
        return self[self.default]


def check_registered(cfg) -> None:
    """Every registry's key in cfg (a key of another family's is passed over): its name, then what
    the named entry needs of the config alone."""
    for registry in REGISTRIES.values():
        section, _, name = registry.key.partition(".")
        if hasattr(getattr(cfg, section), name):
            registry.check(getattr(getattr(cfg, section), name))
            if registry.needs is not None:
                registry.needs(cfg)
