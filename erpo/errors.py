"""The error a user can fix: the CLI prints `erpo: error: <message>` for it and exits 2."""


class ErpoError(Exception):
    """A problem with the user's input (config, paths, data, cache): the CLI prints
    `erpo: error: <message>` and exits 2, without a traceback."""
