"""`mrlx bench credit`: episode credit, per-turn credit and tree sampling on a multi-turn task, and
two games learnt by self-play, on the CPU with small models built here, over several seeds.

Every seed builds its own model and draws its own prompts, warm-start data and sampling. Every arm
of a seed starts from its one format-only warm-start (random answers, random legal moves, never
the right answer; every part's data together), is given its part's reward, and trains until it
has spent its part's engine calls: the embedded trainer's `--engine-call-budget` stops it after
the step that reaches the budget (an arm spends at most one step's calls more; the calls
actually spent are reported).

1. `chain` (a start value, then 3 steps of + or - 1 or 2; each turn the model gives the running
   value as \\boxed{N}; a right value earns 1 and goes on, a wrong one ends the episode; the
   outcome is 1 when every step was right). Arms: `episode` (one sample per episode, trained on
   the outcome plus its steps' rewards: the reward the turn arms share out), `turn` (a sample per
   turn, discount --gamma), `tree` (K candidates per turn, each scored by playing the chain on
   from it, the episode going on from the best, every candidate trained on its score),
   `tree-random` (the same, going on from a candidate drawn uniformly: the policy's own
   continuation with the same sibling-group credit, so `tree` against it separates best-of-K
   continuation from the credit) and `tree-old` (the estimator before: going on from the best,
   the taken candidate trained on its realised return, the others on what they settle at once).
   Evaluated on held-out chains, none seen in training and none whose start value and first step
   open any training chain: success (every step right) and steps right.
2. `nim` (one pile, take 1 to 3, who takes the last stone wins): self-play with per-turn credit
   (`nim`: GRPO, lone turns 0), with mean-only advantages and a running baseline for lone turns
   (`nim-mean`), and with tree sampling too (`nim-tree`). Trained on starting piles 3, 4, 6, 8 and 9;
   evaluated against `script:random` and `script:optimal` in both seat orders, on those piles and
   on the held-out starting piles 5 and 7 apart; and probed: the share of optimal moves from
   winning positions.
3. `kuhn` (Kuhn poker): self-play with per-turn credit (`kuhn`, as `nim`; `kuhn-mean`, as
   `nim-mean`; `kuhn-entropy`, `kuhn-mean` with an entropy bonus); the learned policy is probed at
   its 12 information states and scored by its exploitability (OpenSpiel; uniform play: 0.458).
   So are --snapshots policies evenly spaced in training steps (every step's checkpoint kept,
   loaded into the arm's engine after training): their average policy, each snapshot weighted
   alike in time and by its own seat's reach of each information state, is what fictitious play
   drives to an equilibrium, and its exploitability is reported beside the last iterate's.

The arms run by default are the games' controls and their `-mean` arms (`DEFAULT_ARMS`);
`--arms all` adds the chain's, `nim-tree` and `kuhn-entropy`.

A probe asks the arm's engine for N answers (temperature 1) to each position, rendered as the game
system renders it for that seat (its observations, its own earlier moves, the other seat's moves
told through `describe_move`). An answer that makes no legal move is counted as illegal; the
policy is the legal answers' shares, renormalised over the legal moves (uniform where no answer
was legal).

Units (a seed's warm-start, then each part of it) run --jobs at a time, each a process of its own
with one thread per engine and trainer; a part runs its arms one after another, each arm one
embedded engine and one embedded trainer (`python -m mrlx_plugin.local.trainer`, calling the
plugin's rollout functions as slime does).
"""
