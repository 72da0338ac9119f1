"""Integrations with training frameworks. Each is a module of its own that imports its framework lazily, so
``import flashdist`` needs torch alone: ``from flashdist.integrations import deepspeed`` (DeepSpeed ZeRO, also as
Accelerate and the Trainer call it), ``from flashdist.integrations import transformers`` (the Trainer's
``optim="flash_adamw"``). Recipes for every client: docs/integrations.md."""
