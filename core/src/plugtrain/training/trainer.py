"""The trainer: builds the run from its config, then loops over steps, firing the hooks.

The step itself (:meth:`Trainer.train_step`) fits on one screen and names each hook it fires in
the order of ``hookspecs.py``; everything it needs is built in :meth:`Trainer.__init__` from the
sub-packages ``model`` (the transformer, sharded with FSDP2), ``data``, ``checkpoint``,
``observability`` (metrics, timing, the hook trace) and ``host`` (the plugins), and from this
package's ``run_data`` (the datasets and batches), ``loss`` (the loss, chosen once), ``step``
(each microbatch's forward and backward), ``validation``, ``optim`` (optimizer, LR schedule),
``vetoes``, ``run_log``, ``run_info``, ``requests`` and ``stop``. The trainer keeps the build
order, the schedule of steps, validations and checkpoints, and the stop.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from functools import partial

import torch
from torch import nn

from plugtrain import sample
from plugtrain.checkpoint import (
    CheckpointManager,
    InitialLoad,
    export_checkpoint,
    initial_load_ignored,
    open_initial_load,
    seed_generators,
)
from plugtrain.config import JobConfig
from plugtrain.data import MicroBatch, Tokenizer
from plugtrain.distributed import ParallelDims, init_parallel_dims
from plugtrain.host import PluginHost
from plugtrain.model import DTYPES, build_model, conversion_of, model_spec, replica_sync
from plugtrain.observability import (
    HookTracer,
    MetricsLogger,
    StepTimer,
    setup_logging,
    tracing_requested,
    write_run_records,
)
from plugtrain.plugin import (
    ModelContext,
    OptimizerContext,
    RunControl,
    SetupContext,
    StepContext,
    data_parallel_group,
)
from plugtrain.training.conversion import fire_convert_model, trainable_named_parameters
from plugtrain.training.dump_folder import lock_dump_folder
from plugtrain.training.layout import model_layout
from plugtrain.training.loss import RunLoss
from plugtrain.training.optim import LRSchedule, build_optimizer, plugin_optimizer
from plugtrain.training.requests import RunRequests
from plugtrain.training.run_data import open_training_data, run_datasets
from plugtrain.training.run_info import RunInfo
from plugtrain.training.run_log import RunLog
from plugtrain.training.step import StepRunner
from plugtrain.training.stop import StopSignals
from plugtrain.training.validation import Validation
from plugtrain.training.vetoes import Vetoes

logger = logging.getLogger("plugtrain")

StepBatch = Sequence[MicroBatch]
"""The microbatches of one optimizer step, on this rank."""


class Trainer:
    """One training run: the model, its data, optimizer and schedule, and the plugins' hooks."""

    def __init__(self, config: JobConfig, host: PluginHost) -> None:
        self.config, self.host, self.hook = config, host, host.hook
        self.parallel_dims: ParallelDims = init_parallel_dims(
            config.training.device, config.parallelism
        )
        setup_logging(self.parallel_dims.rank, config.metrics.log_all_ranks)
        # Before anything is written to the folder; a second run must leave it untouched.
        self.dump_folder_lock = lock_dump_folder(config.job.records_folder, self.parallel_dims)
        try:
            self._build()
        except BaseException:
            self.dump_folder_lock.release(failed_start=True)
            raise

    def _build(self) -> None:
        """Everything else of the run, step by step; ``__init__`` unlocks the dump folder if
        this fails."""
        # Before any hook: a plugin drawing random numbers is reproducible (a resume restores
        # the checkpoint's states instead).
        seed_generators(self.config.training.seed, self.parallel_dims.rank)
        self.device = self.parallel_dims.device
        self.param_dtype = DTYPES[self.config.training.mixed_precision_param]
        self.reduce_dtype = DTYPES[self.config.training.mixed_precision_reduce]
        self._open_initial_load()
        self._open_data()
        self._build_model()
        self.optimizer, self.optimizer_builder = self._build_optimizer()
        """The optimizer, and who built it: ``core`` or the plugin that answered."""
        if self.initial_load is not None:
            self.initial_load.check(self.model, self.model_args, self.config.model.tokenizer_path)
            self.initial_load.load(self.model, self.optimizer, self.model_args)
        self.lr_scheduler = LRSchedule(
            self.optimizer, self.config.lr_scheduler, self.config.training.steps
        )
        self.vetoes = Vetoes(self.device)
        self.step = 0
        """Optimizer steps completed (vetoed ones included)."""
        self.tokens_seen = 0
        """Training tokens consumed, over all ranks."""
        self._build_observability()
        self._setup_plugins()
        self._build_checkpointing()
        if self.step < self.config.training.steps:  # a finished run writes nothing
            self._start_records()

    def _open_initial_load(self) -> None:
        """Where a fresh start's weights come from: checked first, so that a bad folder is
        refused before anything else is done."""
        self.initial_load: InitialLoad | None = None
        """Where a fresh start's weights come from (checkpoint.initial_load_path), if anywhere."""
        config = self.config
        if config.checkpoint.initial_load_path:
            ignored = initial_load_ignored(config.checkpoint, config.job.dump_folder)
            if ignored:
                logger.info("%s", ignored)
            else:
                self.initial_load = open_initial_load(config.checkpoint)

    def _open_data(self) -> None:
        """The tokenizer, the datasets and the training batches (``run_data``)."""
        self.tokenizer = Tokenizer.from_file(sample.resolve(self.config.model.tokenizer_path))
        self.control = RunControl()
        data = open_training_data(self.config, self.parallel_dims, self.control)
        self.train_data, self.val_data, self.batches = data.train, data.validation, data.batches
        self.chat_template, self.data_kind = data.chat_template, data.kind

    def _build_model(self) -> None:
        """The run's loss (``training.loss``), then the model: built on the meta device,
        through the model hooks, sharded and initialised."""
        train_cfg = self.config.training
        self.model_spec = model_spec(self.config.model.family)
        """The model's family: its builder, TP plan, HF format, FLOPs (``model.ModelSpec``)."""
        self.model_args = self.config.model.model_args(self.tokenizer.vocab_size, train_cfg.seq_len)
        self.model_spec.check_parallel(self.model_args, self.parallel_dims.tp, train_cfg.seq_len)
        masked = self.train_data.loss_mask
        self.loss = RunLoss(
            tp=self.parallel_dims.tp,
            chunks=self.config.model.loss_chunks,
            masked=masked,
            # The group only where it is used: on a 2-D mesh its first call creates it.
            group=data_parallel_group(self.parallel_dims) if masked else None,
        )
        self.build_like = partial(
            build_model,
            self.model_spec,
            self.model_args,
            self.parallel_dims.get_mesh("dp"),
            self.param_dtype,
            self.reduce_dtype,
            self.device,
            train_cfg.seed,
            init_weights=False,
            **model_layout(self.config, self.parallel_dims, self.model_spec),
        )
        """Builds a model laid out like the run's, without the model hooks, its weights empty."""
        init = self.initial_load is None
        self.model = self.build_like(transform=self._transform_model, init_weights=init)
        self.params = tuple(p for _, p in trainable_named_parameters(self.model))
        """The trainable parameters, in order, for the step hooks and the optimizer."""
        self.sync_replicas = replica_sync(self.model, self.parallel_dims.get_mesh("dp"))
        """HSDP: whether the next backward all-reduces the gradients across replicas."""

    def _build_observability(self) -> None:
        """Metrics, the step timer, the run's log lines and records, the hook trace."""
        config, dims = self.config, self.parallel_dims
        self.metrics = MetricsLogger(config, enabled=dims.is_main)
        self.timer = StepTimer(self.device)
        self.log = RunLog(config, dims, self.model_spec, self.model_args, self.param_dtype)
        self.info = RunInfo(config, dims, self.train_data, self.chat_template)
        self.tracer: HookTracer | None = None
        if tracing_requested(config.metrics.trace_hooks):
            self.tracer = HookTracer.install(self.host, config.job.records_folder, dims.rank)

    def _build_checkpointing(self) -> None:
        """The stop signals, checkpoints and run requests; resumes the latest checkpoint, if any."""
        config = self.config
        # SIGTERM only with checkpoints: without, stopping saves nothing (see stop.py).
        self.stop = StopSignals(self.parallel_dims.world_size, sigterm=config.checkpoint.enable)
        self.checkpointer = CheckpointManager(
            config.checkpoint,
            config.job.dump_folder,
            self.parallel_dims,
            config.training.steps,
            self.model,
            self.optimizer,
            states={"lr_scheduler": self.lr_scheduler, "data": self.batches, "train": self}
            | self.runner.states,
            host=self.host,
            run_config=config,
            chat_template=self.chat_template,
        )
        folder, dims = config.job.records_folder, self.parallel_dims
        self.requests = RunRequests(self.control, self.batches, self.checkpointer, folder, dims)
        self.requests.resume()

    def _start_records(self) -> None:
        """Start the metrics and write the run's records: after the load, so that a refused
        resume leaves them untouched."""
        self.metrics.start(self.step)
        if not self.parallel_dims.is_main:
            return
        config = self.config
        steps, lr = config.training.steps, config.optimizer.lr
        resized = self.lr_scheduler.resize_note(steps, self.step, lr)
        if resized is not None:
            logger.warning("%s", resized)
        write_run_records(
            config,
            self.host.report(),
            self.parallel_dims.world_size,
            self.device,
            resumed_from=self.checkpointer.resumed_from,
            initial_load=None if self.initial_load is None else self.initial_load.record(),
            lr_schedule_steps=self.lr_scheduler.total_steps,
            checkpoints=self.checkpointer.destination,
            setup=self.info.setup,
        )

    def _transform_model(self, model: nn.Module) -> None:
        """Fire the model hooks on the unsharded model, on the meta device: convert, wrap,
        then compile; keep the training loss function they leave (a compiler may compile it)."""
        fire_convert_model(self.hook, self.config, model, self.host.name_of, self.parallel_dims)
        ctx = ModelContext(
            config=self.config,
            model=model,
            blocks=tuple(model.layers.values()),
            norm=model.norm,
            loss_fn=self.loss.fn,
            device=self.device,
            param_dtype=self.param_dtype,
            reduce_dtype=self.reduce_dtype,
            parallel_dims=self.parallel_dims,
            name_of=self.host.name_of,
        )
        self.hook.wrap_model(ctx=ctx)
        self.hook.compile_model(ctx=ctx)
        self.loss.fn = ctx.loss_fn

    def _build_optimizer(self) -> tuple[torch.optim.Optimizer, str]:
        """The optimizer one plugin builds (``build_optimizer``), else the core's fused AdamW,
        and who built it (the plugin's name, or ``core``)."""
        ctx = OptimizerContext(
            config=self.config,
            named_parameters=trainable_named_parameters(self.model),
            optimizer_config=self.config.optimizer,
            device=self.device,
            parallel_dims=self.parallel_dims,
            name_of=self.host.name_of,
        )
        built = plugin_optimizer(
            self.host.results("build_optimizer", ctx=ctx), self.params, self.device
        )
        if built is None:
            return build_optimizer(self.model, self.config.optimizer, self.device), "core"
        builder, optimizer = built
        return optimizer, builder

    def _setup_plugins(self) -> None:
        dims = self.parallel_dims
        ctx = SetupContext(
            config=self.config,
            model=self.model,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            param_dtype=self.param_dtype,
            reduce_dtype=self.reduce_dtype,
            device=self.device,
            parallel_dims=dims,
            name_of=self.host.name_of,
            export_hf=partial(export_checkpoint, conversion=conversion_of(self.model)),
            control=self.control,
            tokenizer=self.tokenizer,
            data_kind=self.data_kind,
            build_like=self.build_like,
            datasets=run_datasets(self.train_data, self.val_data),
        )
        self.host.setup(ctx)
        self.metrics.shown = ctx.console
        self.loss_scaler = ctx.loss_scaler
        runner = self.model, self.loss, self.host, ctx, self.sync_replicas, self.timer
        self.runner = StepRunner(*runner)
        """The model's work in each step: forward, loss (or a plugin's), loss terms, backward."""
        self.validation: Validation | None = None
        if self.val_data is not None:
            args = self.model, self.val_data, self.runner.loss, self.tokenizer, self.host, dims
            self.validation = Validation(self.config, *args, self.runner)
        if self.param_dtype == torch.float16 and ctx.loss_scaler is None and dims.is_main:
            warnings.warn(
                "training.mixed_precision_param is float16 but no enabled plugin scales the "
                "loss: small gradients may underflow to zero; enable the 'grad_scaler' plugin",
                stacklevel=2,
            )

    def state_dict(self) -> dict[str, int | torch.Tensor]:
        """The trainer's own counters, for checkpoints."""
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "skipped_steps": self.vetoes.total,
        }

    def load_state_dict(self, state_dict: dict[str, int | torch.Tensor]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.step = int(state_dict["step"])
        self.tokens_seen = int(state_dict["tokens_seen"])
        self.vetoes.total.copy_(state_dict["skipped_steps"])

    def train_step(self, batch: StepBatch) -> tuple[torch.Tensor, StepContext]:
        """One optimizer step over ``batch``'s microbatches; returns its mean loss and context.

        It fires the step's hooks in the contract's order and reads nothing from the device:
        the loss, the vetoes and the skip stay tensors.
        """
        ctx = StepContext(
            self.step + 1,
            len(batch),
            self.model,
            self.optimizer,
            self.params,
            loss_scaler=self.loss_scaler,
            batch=self.batches.drawn,
            control=self.control,
        )
        lap = self.timer.lap  # each lap ends a phase of the step: see StepTimer
        # Each microbatch: forward, loss, loss_terms, pre_backward, backward (training/step.py).
        loss_sum = self.runner.forward_backward(ctx, batch)
        lap("fwd_bwd")
        self.hook.unscale_gradients(ctx=ctx)
        self.hook.observe_gradients(ctx=ctx)
        self.hook.post_backward(ctx=ctx)
        vetoes = self.host.results("pre_step", ctx=ctx)
        ctx.skipped, ctx.skip_reasons = self.vetoes.combine(vetoes)
        lap("hooks")
        if ctx.skip_reasons:
            logger.info("step %d skipped: %s", ctx.step, "; ".join(ctx.skip_reasons))
        self.vetoes.apply(self.optimizer, ctx.skipped, ctx.skip_reasons)
        self.lr_scheduler.step(ctx.skipped.logical_not())
        lap("optimizer")
        self.hook.post_step(ctx=ctx)
        lap("hooks")
        self.optimizer.zero_grad(set_to_none=True)
        lap("optimizer")
        self.step = ctx.step
        self.tokens_seen += self.config.training.batch_size * self.config.training.seq_len
        return loss_sum, ctx

    def train(self) -> None:
        """Train until ``training.steps``, logging and validating on schedule."""
        cfg = self.config
        if self.step >= cfg.training.steps:
            self.log.complete(self.step)
            return
        self.log.start(self.model, self.optimizer, self.optimizer_builder)
        self.info.start(self.batches)
        self.model.train()
        self.stop.install()
        while self.step < cfg.training.steps:
            logging_step = self._due(cfg.metrics.log_freq, self.step + 1) or self.step == 0
            lr = self.lr_scheduler.last_lr().clone() if logging_step else None
            self.timer.start_step()
            batch = self.batches.next_batch()
            self.timer.lap("data")
            loss, ctx = self.train_step(batch)
            self.batches.prefetch()
            self.timer.lap("data")
            if lr is not None:
                self._log_step(loss, ctx, lr)
            if self.validation is not None and self._due(cfg.validation.interval, self.step):
                self.metrics.log({"step": self.step, **self.validate()})
            signal = self.stop.vote()
            stop = signal.name if signal is not None else self.control.requested_stop
            self.checkpointer.after_step(self.step, stop is not None)
            if self.requests.after_step():
                # The steps after the checkpoint rewound to are undone: so are their records.
                self.metrics.start(self.step)
            if stop is not None:
                self.log.stopped(self.step, stop)
                break

    def _due(self, every: int, step: int) -> bool:
        return step % every == 0 or step == self.config.training.steps

    def _log_step(self, loss: torch.Tensor, ctx: StepContext, lr: torch.Tensor) -> None:
        """Log the step's record (read from the device: a logging step's one host sync)."""
        times = self.timer.window()
        step_metrics = self.host.results("step_metrics", ctx=ctx) | self.runner.metrics()
        loss_terms, vetoes = self.runner.loss_terms, self.vetoes
        record = self.log.record(
            self.step, loss, lr, times, step_metrics, loss_terms, vetoes, self.train_data
        )
        self.metrics.log(record)

    def validate(self) -> dict[str, float | str]:
        """The validation losses and metrics of every weight set (see :class:`Validation`)."""
        assert self.validation is not None, "validation.interval is 0"
        return self.validation(self.step)

    def run(self) -> None:
        """Train, then :meth:`close` and sum the run up; on any error :meth:`abort` instead,
        and re-raise.

        No collective (no barrier) on the way out of an error: the other ranks may be blocked
        in one that this rank will never join.
        """
        try:
            self.train()
            self.close()
        except BaseException:
            self.abort()
            raise
        self.info.finish(self.step, self.checkpointer, self.metrics.path)

    def close(self) -> None:
        """End the run: finish a save in flight (collective), then :meth:`abort` (no teardown)."""
        try:
            self.stop.close()
            self.checkpointer.close()
        finally:
            self.abort()

    def abort(self) -> None:
        """End the run after an error without a collective, since a failed rank may never join
        one: abandon a save in flight, close the run's files (metrics, hook trace), give the
        signal handlers back and unlock the dump folder (idempotent)."""
        try:
            self.stop.close(wait=False)
            self.checkpointer.abort()
            if self.tracer is not None:
                self.tracer.close()
                self.tracer = None
            self.metrics.close()
        finally:
            self.dump_folder_lock.release()
