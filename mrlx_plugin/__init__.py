"""mrlx_plugin: multi-agent reinforcement learning for slime and Miles.

Start with `mrlx_plugin.hookspecs` (the extension surface) and `mrlx_plugin.rollout` (the
functions the host's flags name).
"""

from .config import ConfigError
from .episode import Episode, EpisodeAborted
from .hookspecs import hookimpl
from .host import HOST, Sample
from .transcript import Transcript, Turn

__version__ = "0.1.0"

__all__ = [
    "HOST",
    "ConfigError",
    "Episode",
    "EpisodeAborted",
    "Sample",
    "Transcript",
    "Turn",
    "__version__",
    "hookimpl",
]
