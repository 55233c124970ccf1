"""The PyTorch engine's hooks: ``engine`` (the keyed input processor), ``models`` (the model
hooks, their vision cost: ``visioncost``), ``prefix`` (prefix caching across images), ``budgets``
(the cache's budgets from the engine's memory) and the multi-process mode: ``processes`` (what
lmdeploy's engine process and ranks are handed), ``ranks`` (each model process's cache),
``rankstats`` (its counters), ``rebuild`` (pixels rebuilt where features were lost). Never imports
``featcache.lmdeploy.turbomind`` (.importlinter)."""
