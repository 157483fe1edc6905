"""A 2-rank DDP run on CPU (gloo) for tests/test_lightning.py, launched as a subprocess:
rank 1 alone makes a NaN at batch 2 (in a side branch that reaches neither the loss nor the
gradients, so rank 0 sees nothing by itself). Each rank writes ``result-rank<r>.json``.

Usage: python tests/_lightning_ddp.py OUT_DIR ACTION [STRATEGY]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main() -> None:
    out, action = Path(sys.argv[1]), sys.argv[2]
    strategy = sys.argv[3] if len(sys.argv) > 3 else "ddp"

    import lightning.pytorch as L
    import torch
    from lightning.pytorch.loggers import CSVLogger
    from nanwatch.callbacks import NanWatchCallback

    from tests._lightning_models import model_class

    class Results(L.Callback):  # type: ignore[misc]
        """Writes what each rank saw, from inside the rank (ddp_spawn too)."""

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            nw = watch.watcher
            assert nw is not None
            notes = [n.data for t in nw.history for n in t.notes if n.kind == "distributed"]
            result = {
                "rank": trainer.global_rank,
                "world": trainer.world_size,
                "global_step": trainer.global_step,
                "steps": [t.step for t in nw.history],
                "anomalies": [a.step for a in nw.anomalies],
                "skipped": watch.skipped,
                "stopped_at": watch.stopped_at,
                "notes": notes,
                "params": [p.detach().flatten().tolist() for p in pl_module.parameters()],
                "finite": all(bool(torch.isfinite(p).all()) for p in pl_module.parameters()),
            }
            path = out / f"result-rank{trainer.global_rank}.json"
            path.write_text(json.dumps(result))

        def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
            nw = watch.watcher
            path = out / f"teardown-rank{trainer.global_rank}.json"
            reports = [str(p) for p in watch.report_paths]
            path.write_text(json.dumps({"attached": bool(nw and nw.attached), "reports": reports}))

    torch.manual_seed(0)
    model = model_class("lightning.pytorch")(bad=[2], bad_rank=1, detached=True)
    watch = NanWatchCallback(on_anomaly=action)  # type: ignore[arg-type]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=1,
        limit_train_batches=5,
        limit_val_batches=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=CSVLogger(out),
        log_every_n_steps=1,
        callbacks=[watch, Results()],
    )
    trainer.fit(model)


if __name__ == "__main__":
    main()
