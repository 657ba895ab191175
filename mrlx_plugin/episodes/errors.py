"""The exceptions of an episode: how a system, a turn or a hook's answer ends one."""


class EpisodeAborted(Exception):
    """Raised inside a system when its episode cannot go on; `run_episode` turns it into samples."""


class HookResultError(ValueError):
    """A hook implementation returned something its contract does not allow (names the plugin)."""
