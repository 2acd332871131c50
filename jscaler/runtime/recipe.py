"""The training recipe: an optax optimizer from the knobs users expect.

A :class:`Recipe` is a frozen value (optimizer, learning rate, warm-up and decay schedule,
gradient clipping by global norm, weight decay) that builds one
``optax.GradientTransformation`` for :func:`jscaler.parallelize` and the learning-rate
schedule it follows, so a logger can print the rate each update used::

    recipe = jscaler.Recipe("adamw", lr=3e-4, warmup_steps=100, schedule="cosine",
                            steps=2000, clip_grad_norm=1.0, weight_decay=0.1)
    trainer = jscaler.parallelize(model, loss, recipe.build(), batch, plan=plan)
    recipe.learning_rate(0)   # 0.0: the warm-up starts from zero

The defaults are Adam at a constant rate with nothing else (``optax.adam(lr)`` itself).
"""

from __future__ import annotations

from dataclasses import dataclass

import optax

from jscaler.errors import ConfigError

__all__ = ["OPTIMIZERS", "SCHEDULES", "Recipe"]

OPTIMIZERS = ("adam", "adamw", "sgd")
SCHEDULES = ("constant", "cosine", "linear")


@dataclass(frozen=True)
class Recipe:
    """An optimizer and its learning-rate schedule.

    Attributes:
      optimizer: ``"adam"``, ``"adamw"`` (decoupled weight decay) or ``"sgd"``.
      lr: the peak learning rate (the rate after warm-up).
      schedule: ``"constant"``, ``"cosine"`` or ``"linear"``: after ``warmup_steps`` of a
        linear rise from 0, the rate stays at ``lr`` (constant) or decays to ``min_lr``
        at update ``steps`` (cosine, linear) and stays there.
      warmup_steps: updates of the linear warm-up from 0 to ``lr`` (0: none).
      steps: the updates in the run (where a decaying schedule reaches ``min_lr``).
      min_lr: the rate a decaying schedule ends at.
      clip_grad_norm: clip the gradients to this global norm before the optimizer
        (``optax.clip_by_global_norm``; 0: no clipping).
      weight_decay: ``adamw``'s decoupled weight decay, or ``sgd``'s (added to the
        gradient, as PyTorch's SGD does); 0 for ``adam`` (use ``adamw``).
    """

    optimizer: str = "adam"
    lr: float = 1e-2
    schedule: str = "constant"
    warmup_steps: int = 0
    steps: int | None = None
    min_lr: float = 0.0
    clip_grad_norm: float = 0.0
    weight_decay: float = 0.0

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(
                f"optimizer={self.optimizer!r}: expected one of {', '.join(OPTIMIZERS)}"
            )
        if self.schedule not in SCHEDULES:
            raise ConfigError(
                f"lr schedule {self.schedule!r}: expected one of {', '.join(SCHEDULES)}"
            )
        for name in ("warmup_steps", "min_lr", "clip_grad_norm", "weight_decay"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name}={getattr(self, name)}: must be 0 or more")
        if self.schedule != "constant":
            if self.steps is None or self.steps <= self.warmup_steps:
                raise ConfigError(
                    f"a {self.schedule} schedule decays from update warmup_steps="
                    f"{self.warmup_steps} to update steps={self.steps}: give steps greater "
                    f"than warmup_steps (lower --warmup-steps or raise --steps)"
                )
        if self.optimizer == "adam" and self.weight_decay:
            raise ConfigError(
                f"weight_decay={self.weight_decay} with adam: use --optimizer adamw (decoupled "
                f"weight decay), or sgd"
            )

    def learning_rate(self, update: int) -> float:
        """The rate update number ``update`` (0 for the first) uses."""
        return float(self.lr_schedule()(update))

    def lr_schedule(self) -> optax.Schedule:
        """The learning rate as a function of the update count (optax's convention: the
        count of updates applied before this one)."""
        lr, warm = self.lr, self.warmup_steps
        if self.schedule == "cosine":
            return optax.warmup_cosine_decay_schedule(
                0.0, lr, warm, self.steps, end_value=self.min_lr
            )
        if self.schedule == "linear":
            decay = optax.linear_schedule(lr, self.min_lr, self.steps - warm)
        else:
            decay = optax.constant_schedule(lr)
        if not warm:
            return decay
        return optax.join_schedules([optax.linear_schedule(0.0, lr, warm), decay], [warm])

    def build(self) -> optax.GradientTransformation:
        """The transformation to train with: clipping by global norm (if any), then the
        optimizer at :meth:`lr_schedule`."""
        constant = self.schedule == "constant" and not self.warmup_steps
        lr = self.lr if constant else self.lr_schedule()  # a float: optax.adam(lr) itself
        if self.optimizer == "adamw":
            opt = optax.adamw(lr, weight_decay=self.weight_decay)
        elif self.optimizer == "sgd" and self.weight_decay:
            opt = optax.chain(optax.add_decayed_weights(self.weight_decay), optax.sgd(lr))
        elif self.optimizer == "sgd":
            opt = optax.sgd(lr)
        else:
            opt = optax.adam(lr)
        if self.clip_grad_norm:
            return optax.chain(optax.clip_by_global_norm(self.clip_grad_norm), opt)
        return opt
