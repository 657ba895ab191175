"""The values a model's answer can hold: one definition for the engine client, which checks an
engine's answers, and the wire protocol, which checks what the coordinator queues."""

# Log-probs must be <= 0; a sampler's float arithmetic can land a hair above zero for a token of
# probability ~1, so values up to this epsilon are accepted as they are (not clamped).
LOG_PROB_EPSILON = 1e-3
# The lowest log-prob accepted. An engine samples a token from a float32 softmax, in which a
# probability below the smallest positive float32 (about 1.4e-45, log -103.3) is zero and never
# sampled; a log-prob reported from another distribution than the one sampled from (before the
# temperature, or for a token a grammar forced) is lower by the logit gap, a few hundred at most
# for real models. -1e4 accepts all of these and keeps every accepted value, and its difference
# to any other log-prob, an ordinary float32, while -1e30 makes a trainer's loss infinite and
# -1e39 is past float32 (the coordinator's frames cannot carry it).
MIN_LOG_PROB = -1e4
MAX_TOKEN_ID = 2**31 - 1  # token ids travel as int32 (mrlx_plugin.link.wire)
