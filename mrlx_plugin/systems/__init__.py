"""The built-in agent systems, registered by `mrlx_plugin.defaults`: the solver -> rewriter ->
selector pipeline (`pipeline`) and the turn-taking dialogue (`dialogue`). They use only `core`."""
