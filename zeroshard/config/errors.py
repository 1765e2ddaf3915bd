"""The one exception of the config layer (its own module, so that every config module can raise it)."""


class ConfigError(ValueError):
    """A configuration value zeroshard refuses, with the key that holds it and how to fix it."""
