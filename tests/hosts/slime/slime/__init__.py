"""A host-shaped fake of slime (THUDM/slime, v0.3.1 line) for the plugin's tests.

slime cannot be installed here (it needs Ray, Megatron and SGLang). This package has the module
layout of the real host for the modules the plugin imports or relies on, and models only the
behaviour and invariants the plugin depends on: the Sample type, the rollout manager's order of
work, the default and fully-async rollouts (over-sampling, abort, recycling), logging hooks,
argument handling and the data-parallel split. Everything runs in one process without Ray.
Put `tests/hosts/slime` and `tests/hosts` on PYTHONPATH to import it as `slime`.
"""
