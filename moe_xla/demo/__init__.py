"""Train a small Mixture-of-Experts language model with moe_xla: `python3 -m moe_xla.demo`
(needs the "demo" extra: flax, optax, orbax-checkpoint, tqdm, matplotlib).

The data is characters: by default a corpus the demo generates itself (no download):
sentences from a small grammar ("the robot paints a red kite near the river."), additions
("7 plus 5 is 12.") and counting runs ("count 4 5 6 7."), 262144 characters with a fixed
seed, on which the loss falls from about 3.7 to about 0.4 in the default 400 steps; with
`--text PATH`, any UTF-8 text file.

The model (model.py) is a decoder-only transformer in Flax NNX whose feed-forward layers
are moe_xla.nnx.MoE, stacked with nnx.vmap and run with nnx.scan; the MoE options of the
command line (--activation, --score, --quantization) are passed to every MoE layer
(--quantization fp8_blockwise runs both expert products in FP8 blockwise, moe_xla.fp8).
One training step (train.py: batch sampling on the device, value_and_grad, optax's
clipping and Adam) is a single jitted function, compiled ahead of time.

What a run writes under --out (default moe_xla_demo_out/):
    train_step_hlo.txt   the optimised HLO of one training step; the moe_xla custom calls in
                         it (moe_xla_<op>_<platform>_v<N>) are listed on stdout
    loss.png             the loss curve
    expert_load.png      each expert's load over the steps, per layer
    checkpoints/<step>/  orbax checkpoints every --checkpoint-every steps and at the last;
                         --resume continues from the newest (checkpoints.py), a run without
                         it replaces them
    summary.json         the run's arguments, device and model; first and last loss, the
                         final loss (the mean over the last 50 steps, or over all of a shorter
                         run: what benchmarks/demo_fp8_vs_bf16.py compares), ms/step and tokens/s
It prints the loss every tenth of the run, the final loss, tokens/s, the per-expert load of
the last step and a text sample drawn from the model. The exit status is 1 when the last
step's loss is not below the first one.

The defaults run in about a minute on a 2-core CPU; scale up on a GPU, e.g.
`python3 -m moe_xla.demo --steps 2000 --batch 64 --seq 256 --hidden 512 --heads 8
--experts 64 --top-k 4 --layers 8 --dtype bfloat16`.
"""
