"""The demo's training step: loss, optax optimiser, and one step as a pure function of a TrainState.

    loss = cross_entropy + 0.01 * load_balance_loss + 0.001 * z_loss
           (the two router losses of moe()'s MoeAux, averaged over layers)
    optimiser = clip to global norm 1, then Adam (b2 0.95) with linear warmup over the
                first 5% of the steps and cosine decay to a tenth of the peak rate

The model lives in the step as (graphdef, params): nnx.split outside, nnx.merge inside, so
the step is a plain function that jax.jit compiles ahead of time, whose state orbax saves
as it is.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from moe_xla.demo.data import sample_batch

LOAD_BALANCE_COEF = 0.01
Z_LOSS_COEF = 0.001


class TrainState(NamedTuple):
    """Everything a step reads and a checkpoint holds."""

    params: nnx.State  # the model's nnx.Param variables
    opt_state: Any  # optax's state for params
    step: jax.Array  # int32 [], steps done
    key: jax.Array  # uint32 key data (jax.random.key_data) of the batch sampler


def schedule(peak_lr: float, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 over the first 5% of the steps, then cosine decay to peak_lr / 10."""
    return optax.warmup_cosine_decay_schedule(0.0, peak_lr, max(1, total_steps // 20), total_steps,
                                              end_value=peak_lr / 10)


def optimizer(lr: optax.Schedule) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(lr, b1=0.9, b2=0.95))


def init_state(params: nnx.State, tx: optax.GradientTransformation, key) -> TrainState:
    return TrainState(params, tx.init(params), jnp.zeros((), jnp.int32), jax.random.key_data(key))


def loss_fn(params: nnx.State, graphdef: nnx.GraphDef, tokens):
    """Next-token cross entropy of the model on tokens [B, S+1] plus the router losses;
    (total, metrics: loss (the cross entropy), load_balance_loss, z_loss, tokens_per_expert [L, E])."""
    logits, aux = nnx.merge(graphdef, params)(tokens[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    ce = -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))
    balance, z = jnp.mean(aux.load_balance_loss), jnp.mean(aux.z_loss)
    total = ce + LOAD_BALANCE_COEF * balance + Z_LOSS_COEF * z
    return total, {"loss": ce, "load_balance_loss": balance, "z_loss": z, "tokens_per_expert": aux.tokens_per_expert}


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, lr: optax.Schedule, batch: int,
                    seq: int):
    """(state, corpus [N] int32) -> (state, metrics): samples a batch of `batch` windows of
    seq + 1 tokens, takes value_and_grad of loss_fn and applies tx; metrics are loss_fn's
    plus grad_norm and lr."""

    def train_step(state: TrainState, corpus):
        key, batch_key = jax.random.split(jax.random.wrap_key_data(state.key))
        tokens = sample_batch(batch_key, corpus, batch, seq + 1)
        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, graphdef, tokens)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = dict(metrics, grad_norm=optax.tree.norm(grads), lr=lr(state.step))
        return TrainState(params, opt_state, state.step + 1, jax.random.key_data(key)), metrics

    return train_step
