"""Integrations with training libraries. Each lives in its own module and imports its library
there, so ``import invariant_infer`` never needs them: ``invariant_infer.training.integrations.trl`` needs
``pip install -e ".[rl]"``."""
