"""Running episodes: the layer above the plugin manager and below the host-facing functions.

`system` says what an agent system is and how the selected one starts, `context` what the episodes
of a process share (the hooks resolved once), `episode` what a system drives, `turn` one model
turn top to bottom, `outcome` what a system's run returns, `run` one whole episode with its
grades and shaping, and `samples` the host's samples of it. Everything here reads the settings
and calls the hooks it is given; nothing here loads plugins or reads the host's flags.
"""

from mrlx_plugin.episodes.context import EpisodeContext, FirstAnswer, Hooks
from mrlx_plugin.episodes.episode import Episode
from mrlx_plugin.episodes.errors import EpisodeAborted, HookResultError
from mrlx_plugin.episodes.outcome import Outcome
from mrlx_plugin.episodes.run import run_episode
from mrlx_plugin.episodes.system import Registered, System, start_system

__all__ = [
    "Episode",
    "EpisodeAborted",
    "EpisodeContext",
    "FirstAnswer",
    "HookResultError",
    "Hooks",
    "Outcome",
    "Registered",
    "System",
    "run_episode",
    "start_system",
]
