"""The functions a slime launch script names, for the example math team.

They are mrlx_plugin's own; this file only gives them the dotted paths the host's multi-agent
example used, so an existing launch script keeps working:

    --custom-generate-function-path examples.multi_agent.rollout_with_multi_agents.generate_with_multi_agents
    --custom-reward-post-process-path examples.multi_agent.rollout_with_multi_agents.normalize_rewards
    --custom-rollout-log-function-path examples.multi_agent.rollout_with_multi_agents.log_rollout

Settings come from the YAML given with --custom-config-path (see math_team.yaml).
"""

from mrlx_plugin.core.metrics import log_rollout
from mrlx_plugin.rewards.shaping import normalize as normalize_rewards
from mrlx_plugin.rollout import generate as generate_with_multi_agents

__all__ = ["generate_with_multi_agents", "normalize_rewards", "log_rollout"]
