"""mrlx_plugin: multi-agent reinforcement learning for slime and Miles.

Start with `mrlx_plugin.hookspecs` (the extension surface) and `mrlx_plugin.rollout` (the
functions the host's flags name).
"""

from mrlx_plugin.core.config import ConfigError
from mrlx_plugin.core.host import HOST, Sample
from mrlx_plugin.core.transcript import Transcript, Turn
from mrlx_plugin.episodes import Episode, EpisodeAborted, Outcome, System
from mrlx_plugin.hookspecs import hookimpl

__version__ = "0.1.0"

__all__ = [
    "HOST",
    "ConfigError",
    "Episode",
    "EpisodeAborted",
    "Outcome",
    "Sample",
    "System",
    "Transcript",
    "Turn",
    "__version__",
    "hookimpl",
]
