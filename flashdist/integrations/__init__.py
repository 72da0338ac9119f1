"""Integrations with training frameworks. Each is a module of its own that imports its framework lazily, so
``import flashdist`` needs torch alone: ``from flashdist.integrations import deepspeed``."""
