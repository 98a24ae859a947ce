"""Holds the sitecustomize start-up hook of the SGLang recorder (see sitecustomize.py)."""
