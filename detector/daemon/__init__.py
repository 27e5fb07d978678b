"""`gpu-npd run`: the DaemonSet's process, one node agent with its threads, HTTP endpoints and logs."""
