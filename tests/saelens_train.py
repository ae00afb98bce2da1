"""Train a tiny SAE with SAELens on a `capserve export` dataset. Runs in .venv-saelens (SAELens
6.54 cannot share capserve's venv); tests/test_saelens_dataset.py starts it as a subprocess.

    .venv-saelens/bin/python tests/saelens_train.py DATASET --hook H --context-size N --d-in D \\
        --steps S --result result.npz --sae-out sae/

SAELens's own runner does the work, configured the documented way for cached activations:
`LanguageModelSAERunnerConfig(use_cached_activations=True, cached_activations_path=DATASET)`.
The runner also wants a TransformerLens model and a token dataset, though it trains from the
cache alone: with no network, a random 1-layer HookedTransformer (never run: no W&B logging, so no
evals) and the dataset's own `token_ids` as `tokens` stand in for `model_name`/`dataset_path`.

Writes to --result: `acts` and `token_ids`, every row the runner's ActivationsStore reads, in its
order, read through its own `get_raw_llm_batch` before training; and `losses`, the overall loss of
every training step (recorded by wrapping the SAE's `training_forward_pass`, the seam SAELens's
own `compile_sae` uses). The trained SAE is saved to --sae-out by the runner.
"""

from __future__ import annotations

import argparse
import logging

import datasets
import numpy as np
import torch
from sae_lens import (
    LanguageModelSAERunnerConfig,
    LanguageModelSAETrainingRunner,
    LoggingConfig,
    StandardTrainingSAEConfig,
)
from transformer_lens import HookedTransformer, HookedTransformerConfig

BATCH_SEQUENCES = 8  # store_batch_size_prompts: sequences per read from the cache
BATCH_TOKENS = 128  # train_batch_size_tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dataset")
    parser.add_argument("--hook", required=True)
    parser.add_argument("--context-size", type=int, required=True)
    parser.add_argument("--d-in", type=int, required=True)
    parser.add_argument("--d-sae", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--result", required=True)
    parser.add_argument("--sae-out", required=True)
    args = parser.parse_args()
    logging.getLogger("sae_lens").setLevel(logging.WARNING)
    torch.manual_seed(0)
    torch.set_num_threads(1)  # 128-wide matrices: threads only contend (2x slower on a busy 2-core box)

    cfg = LanguageModelSAERunnerConfig(
        sae=StandardTrainingSAEConfig(d_in=args.d_in, d_sae=args.d_sae, l1_coefficient=1e-3),
        model_name="capserve-tiny",  # recorded in the SAE's metadata only: the model is passed below
        hook_name=args.hook,
        context_size=args.context_size,
        use_cached_activations=True,
        cached_activations_path=args.dataset,
        is_dataset_tokenized=True,
        prepend_bos=False,
        training_tokens=args.steps * BATCH_TOKENS,
        train_batch_size_tokens=BATCH_TOKENS,
        store_batch_size_prompts=BATCH_SEQUENCES,
        n_batches_in_buffer=16,
        lr=3e-3,
        device="cpu",
        logger=LoggingConfig(log_to_wandb=False),
        checkpoint_path=None,
        output_path=args.sae_out,
        verbose=False,
    )
    cached = datasets.load_from_disk(args.dataset)
    tokens = datasets.Dataset.from_dict({"tokens": cached["token_ids"]})
    model = HookedTransformer(HookedTransformerConfig(
        n_layers=1, d_model=16, n_ctx=args.context_size, d_head=4, n_heads=4, d_mlp=32,
        d_vocab=int(max(max(t) for t in cached["token_ids"])) + 1, act_fn="relu",
    ))
    runner = LanguageModelSAETrainingRunner(cfg, override_dataset=tokens, override_model=model)

    store = runner.activations_store
    acts, token_ids = [], []
    while True:  # one pass over the cache, as the runner's data loader reads it
        try:
            batch, ids = store.get_raw_llm_batch(raise_on_epoch_end=True)
        except StopIteration:
            break  # the store rewound itself: training starts from row 0
        acts.append(batch.numpy())
        token_ids.append(ids.numpy())

    losses: list[float] = []
    forward = runner.sae.training_forward_pass

    def recording_forward(step_input):
        output = forward(step_input)
        losses.append(float(output.loss.detach()))
        return output

    runner.sae.training_forward_pass = recording_forward
    runner.run()
    np.savez(args.result, acts=np.concatenate(acts), token_ids=np.concatenate(token_ids), losses=np.asarray(losses))


if __name__ == "__main__":
    main()
