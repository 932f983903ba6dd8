"""Errors that rlt-scale raises on purpose, so callers can tell them from bugs."""


class ConfigError(ValueError):
    """A configuration value is missing, mistyped or inconsistent.

    The message always starts with the dotted key at fault (``model.n_heads``)
    and says what was expected.
    """

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}")


class DataError(RuntimeError):
    """A shard, index or sample is unreadable or inconsistent.

    The message names the shard file and, where known, the sample key.
    """


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or of another format.

    The message names the file at fault and, when the newest checkpoint is
    broken, the older complete one that could be used instead.
    """
