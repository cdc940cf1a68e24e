"""One registry type for every config key that names an entry: the pipeline schedules, context
strategies, matmul recipes, optimizers and learning-rate schedules, remat policies, kernels and
model families, each a `Registry` made and filled by the module that implements its entries.

Core cannot import those modules, so each registry files itself here by its key as it is made
(jaxpar's package imports every filling module before any config is read), and the config's
checks (jaxpar.core.config.validate) ask every one of them: a bad name fails where a bad number
fails, in one line naming the choices, before any command does any work. `one_of` refuses a value
of a key whose choices are a fixed tuple.
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
    """The entries one config key names, by name, in the order they are listed.

    `default`: the entry an empty value means (None: an empty value is refused like any other
    unknown name). `also`: values the key takes besides its entries, listed first (the kernel
    keys' `auto`). `needs(cfg)`: what the config alone rules out for the named entry, refused
    in one line as the config is checked (a schedule's layer chunks, a kernel's dtype).
    """

    def __init__(self, key: str, entries: dict | None = None, *, default: str | None = None,
                 also: tuple[str, ...] = (), needs: Callable | None = None):
        super().__init__(entries or {})
        self.key, self.default, self.also, self.needs = key, default, also, needs
        REGISTRIES[key] = self

    def register(self, name: str, entry) -> None:
        """File `entry` under `name`."""
        self[name] = entry

    @property
    def names(self) -> tuple[str, ...]:
        """Every value the key takes."""
        return (*self.also, *self)

    def check(self, value) -> None:
        """Refuse a value that names nothing here, in one line naming the choices."""
        if not (value or self.default is None):  # empty: the default
            return
        one_of(self.key, value, self.names)

    def named(self, name: str):
        """The entry named `name` (empty: the default's), refused in one line where none is."""
        self.check(name)
        return self[name or self.default]

    def check_config(self, cfg) -> None:
        """Check the value cfg gives this key, and what its entry needs of the config alone; a
        key that cfg's sections do not hold (another family's) is passed over."""
        section, _, name = self.key.partition(".")
        holder = getattr(cfg, section)
        if hasattr(holder, name):
            self.check(getattr(holder, name))
            if self.needs is not None:
                self.needs(cfg)


def check_registered(cfg) -> None:
    """Every registry's key in cfg: its name, and what the named entry needs of the config."""
    for registry in REGISTRIES.values():
        registry.check_config(cfg)
