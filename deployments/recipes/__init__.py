"""Recipes in vllm-project/recipes' own YAML layout: a model's `models/<org>/<model>.yaml` and the
`strategies/*.yaml` it names. schema.py reads and checks one file, resolve.py turns a recipe, variant and
strategy into engine flags for a node's GPUs (each with its reason), compat.py is the panel's table of
combinations known to fail. Plain Python, no Django; the database side is deployments/services/recipes.py.
May import the plain-Python flag modules (flagpolicy, userflags, privileged), deployments/host and plumbing."""
