"""The KL calibration step as one CUDA graph (``CalibConfig.cuda_graph``).

On an H200 an eager step of SmolLM2-135M with ~200 ECs is launch-bound: ~2,000 small
kernels, 49 ms of GPU work in 0.43 s of wall time (``benchmarks/results/calibration/2026-11-29_h200_calib_profile.txt``).
Captured once, a step is one graph replay: forward, KL, backward and the Adam update.

How it keeps the eager path's meaning:
- the minibatch is chosen on the host exactly as in the eager loop and copied into static
  input buffers (token ids and the cached teacher log-probs) before each replay;
- the first ``WARMUP`` steps run eagerly on a side stream (they are real training steps, with
  their own minibatches and learning rates), which also creates Adam's state before capture;
- Adam runs with ``capturable=True`` and tensor learning rates, so the schedule's per-step
  ``fill_`` of the lr tensor (outside the graph) reaches the captured update;
- gradients are set to None before capture, so the captured backward writes (not adds) them
  in every replay.
Requires CUDA and the teacher cache (``teacher_cache_bytes``); otherwise the eager loop runs.
"""
from __future__ import annotations

from typing import Callable

import torch

WARMUP = 3  # eager steps before capture (the CUDA graph docs' recipe; Adam's state exists after one)


class GraphedKLStep:
    """Call with the minibatch's sequence indices; returns the step's loss (a device scalar)."""

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], opt: torch.optim.Optimizer,
                 seqs: torch.Tensor, teacher: torch.Tensor, batch_size: int):
        self.loss_fn, self.opt, self.seqs, self.teacher = loss_fn, opt, seqs, teacher
        self.ids = torch.empty((batch_size, *seqs.shape[1:]), dtype=seqs.dtype, device=seqs.device)
        self.t = torch.empty((batch_size, *teacher.shape[1:]), dtype=teacher.dtype, device=teacher.device)
        self.side = torch.cuda.Stream(device=seqs.device)
        self.graph = None
        self.loss = None
        self.calls = 0

    def _load(self, idx: torch.Tensor) -> None:
        idx = idx.to(self.seqs.device)
        self.ids.copy_(self.seqs.index_select(0, idx))
        self.t.copy_(self.teacher.index_select(0, idx))

    def _step(self) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.t, self.ids)
        loss.backward()
        self.opt.step()
        return loss

    def __call__(self, idx: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self._load(idx)
        if self.calls <= WARMUP:
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                loss = self._step().detach()
            torch.cuda.current_stream().wait_stream(self.side)
            return loss
        if self.graph is None:
            self.opt.zero_grad(set_to_none=True)
            self.graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(self.graph):
                    self.loss = self.loss_fn(self.t, self.ids)
                    self.loss.backward()
                    self.opt.step()
            except RuntimeError as e:  # e.g. an op that syncs with the host inside the step
                raise RuntimeError(f"KL calibration: capturing the step as a CUDA graph failed ({e}); "
                                   "run with CalibConfig(cuda_graph=False) (CLI: --set cuda_graph=false), "
                                   "which GPU_PRESET turns on") from e
        self.graph.replay()
        return self.loss.detach()
