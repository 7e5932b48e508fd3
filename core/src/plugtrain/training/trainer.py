"""The trainer: builds the run from its config, then loops over steps, firing the hooks.

The step itself (:meth:`Trainer.train_step`) fits on one screen and names each hook it fires in
the order of ``hookspecs.py``; everything it needs is built in :meth:`Trainer.__init__` from the
sub-packages ``model`` (the transformer, sharded with FSDP2), ``data`` (the batches),
``checkpoint``, ``observability`` (metrics, timing, the hook trace) and ``host`` (the plugins),
and from this package's ``optim`` (optimizer, LR schedule), ``vetoes``, ``loss_terms``,
``requests`` and ``stop``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel

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
from plugtrain.data import (
    IGNORE_INDEX,
    ChatOptions,
    DevicePrefetcher,
    MicroBatch,
    MixtureDataset,
    PackedDataset,
    SkippingLoader,
    StatefulBatchLoader,
    Tokenizer,
    TokenStore,
    count_eval_batches,
    iter_eval_batches,
    open_token_store,
)
from plugtrain.distributed import ParallelDims, all_reduce_mean, init_parallel_dims
from plugtrain.host import PluginHost
from plugtrain.model import (
    DTYPES,
    ChunkedLoss,
    build_model,
    cross_entropy,
    model_spec,
    parallel_cross_entropy,
    parallel_summed_cross_entropy,
    replica_sync,
    reshard,
    summed_cross_entropy,
)
from plugtrain.observability import (
    HookTracer,
    MetricsLogger,
    StepTimer,
    matmul_seconds,
    peak_memory_gib,
    peak_tflops,
    setup_logging,
    throughput,
    to_number,
    tracing_requested,
    write_run_records,
)
from plugtrain.plugin import (
    ModelContext,
    OptimizerContext,
    RunControl,
    SetupContext,
    StepContext,
    ValidationContext,
    data_parallel_group,
)
from plugtrain.training.dump_folder import lock_dump_folder
from plugtrain.training.estimate import estimate_run
from plugtrain.training.loss_mean import StepLoss
from plugtrain.training.loss_terms import LossTerms
from plugtrain.training.optim import (
    LRSchedule,
    build_optimizer,
    describe_param_groups,
    lr_factor,
    plugin_optimizer,
)
from plugtrain.training.requests import RunRequests
from plugtrain.training.stop import StopSignals
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
        """Everything else of the run; ``__init__`` unlocks the dump folder if this fails."""
        config, host, train_cfg = self.config, self.host, self.config.training
        # Before any hook: a plugin drawing random numbers is reproducible (a resume restores
        # the checkpoint's states instead).
        seed_generators(train_cfg.seed, self.parallel_dims.rank)
        self.device = self.parallel_dims.device
        self.param_dtype = DTYPES[train_cfg.mixed_precision_param]
        self.reduce_dtype = DTYPES[train_cfg.mixed_precision_reduce]
        self.initial_load: InitialLoad | None = None
        """Where a fresh start's weights come from (checkpoint.initial_load_path), if anywhere."""
        if config.checkpoint.initial_load_path:
            # Checked first, so that a bad folder is refused before anything else is done.
            ignored = initial_load_ignored(config.checkpoint, config.job.dump_folder)
            if ignored:
                logger.info("%s", ignored)
            else:
                self.initial_load = open_initial_load(config.checkpoint)

        self.tokenizer = Tokenizer.from_file(sample.resolve(config.model.tokenizer_path))
        self.train_data = self._train_dataset()
        self.val_data: PackedDataset | None = None
        if config.validation.interval:
            self.val_data = self._dataset(config.data.validation_path, "data.validation_path")
            self.token_bytes = torch.tensor(self.tokenizer.token_byte_lengths(), device=self.device)
            """The UTF-8 bytes each token id stands for, for ``validation_bpb``."""
            # Now rather than at the first validation, which may come many steps later.
            count_eval_batches(
                self.val_data,
                batch_size=train_cfg.batch_size,
                world_size=self.parallel_dims.dp_size,
                max_batches=config.validation.steps,
            )
        loader = StatefulBatchLoader(
            self.train_data,
            global_batch_size=train_cfg.batch_size,
            grad_accum_steps=train_cfg.grad_accum_steps,
            rank=self.parallel_dims.dp_rank,
            world_size=self.parallel_dims.dp_size,
            seed=train_cfg.seed,
            shuffle=config.data.shuffle,
        )
        self.control = RunControl()
        self.batches = SkippingLoader(
            DevicePrefetcher(loader, self.device), self.control.skip_ranges
        )
        self.model_spec = model_spec(config.model.family)
        """The model's family: its builder, TP plan, HF format, FLOPs (``model.ModelSpec``)."""
        self.model_args = config.model.model_args(self.tokenizer.vocab_size, train_cfg.seq_len)
        self.model_spec.check_parallel(self.model_args, self.parallel_dims.tp, train_cfg.seq_len)
        # Under tensor parallelism the logits are sharded over the vocabulary: the loss (and its
        # backward) is computed on the shards, inside loss_parallel.
        self.loss_parallel = (
            loss_parallel if self.parallel_dims.tp_enabled else contextlib.nullcontext
        )
        self.cross_entropy = (
            parallel_cross_entropy if self.parallel_dims.tp_enabled else cross_entropy
        )
        self.summed_cross_entropy = (
            parallel_summed_cross_entropy if self.parallel_dims.tp_enabled else summed_cross_entropy
        )
        """Chat data's loss: the sum over the counted targets (``loss_mean`` normalises it)."""
        self.model = build_model(
            self.model_spec,
            self.model_args,
            self.parallel_dims.get_mesh("dp"),
            self.param_dtype,
            self.reduce_dtype,
            self.device,
            train_cfg.seed,
            transform=self._transform_model,
            init_weights=self.initial_load is None,
            tp_mesh=self.parallel_dims.get_mesh("tp") if self.parallel_dims.tp_enabled else None,
        )
        self.params = tuple(self.model.parameters())
        """The parameters, in order, for the step hooks (set_state_dict loads into them)."""
        self.sync_replicas = replica_sync(self.model, self.parallel_dims.get_mesh("dp"))
        """HSDP: whether the next backward all-reduces the gradients across replicas."""
        self.optimizer, self.optimizer_builder = self._build_optimizer()
        """The optimizer, and who built it: ``core`` or the plugin that answered."""
        if self.initial_load is not None:
            self.initial_load.check(self.model, self.model_args, config.model.tokenizer_path)
            self.initial_load.load(self.model, self.optimizer, self.model_args)
        self.lr_scheduler = LRSchedule(self.optimizer, config.lr_scheduler, train_cfg.steps)
        self.vetoes = Vetoes(self.device)
        self.step = 0
        """Optimizer steps completed (vetoed ones included)."""
        self.tokens_seen = 0
        """Training tokens consumed, over all ranks."""
        self.metrics = MetricsLogger(config, enabled=self.parallel_dims.is_main)
        self.timer = StepTimer(self.device)
        # Only rank 0 logs metrics, so only it looks the limits up (and warns if unknown).
        self.peak_tflops = (
            peak_tflops(self.device, config.metrics.peak_tflops)
            if self.parallel_dims.is_main
            else None
        )
        self.matmul_step_seconds = self._matmul_limit() if self.parallel_dims.is_main else None
        self.tracer: HookTracer | None = None
        if tracing_requested(config.metrics.trace_hooks):
            self.tracer = HookTracer.install(
                host, config.job.records_folder, self.parallel_dims.rank
            )
        self._setup_plugins()
        # SIGTERM only with checkpoints: without, stopping saves nothing (see stop.py).
        self.stop = StopSignals(self.parallel_dims.world_size, sigterm=config.checkpoint.enable)
        self.checkpointer = CheckpointManager(
            config.checkpoint,
            config.job.dump_folder,
            self.parallel_dims,
            train_cfg.steps,
            self.model,
            self.optimizer,
            states={"lr_scheduler": self.lr_scheduler, "data": self.batches, "train": self},
            host=host,
            run_config=config.to_dict(),
        )
        self.requests = RunRequests(
            self.control,
            self.batches,
            self.checkpointer,
            config.job.records_folder,
            self.parallel_dims,
        )
        self.requests.resume()
        if self.step >= train_cfg.steps:
            return  # a finished run: train() says so, and nothing is written
        # After the load, so that a refused resume leaves the run's records untouched.
        self.metrics.start(self.step)
        if self.parallel_dims.is_main:
            self._warn_if_schedule_differs()
            write_run_records(
                config,
                host.report(),
                self.parallel_dims.world_size,
                self.device,
                resumed_from=self.checkpointer.resumed_from,
                initial_load=None if self.initial_load is None else self.initial_load.record(),
                lr_schedule_steps=self.lr_scheduler.total_steps,
                checkpoints=(
                    str(self.checkpointer.storage.location) if config.checkpoint.enable else None
                ),
            )

    def _matmul_limit(self) -> float | None:
        """Seconds the GEMMs of one of this rank's steps alone take, timed on this CPU
        (``metrics.matmul_limit``); None on CUDA, whose limit is its peak."""
        train_cfg = self.config.training
        if self.device.type != "cpu" or not self.config.metrics.matmul_limit:
            return None
        accum = train_cfg.grad_accum_steps
        rows = train_cfg.batch_size // (self.parallel_dims.world_size * accum)
        gemms = self.model_spec.gemms(self.model_args, rows, train_cfg.seq_len)
        return accum * matmul_seconds(gemms, self.device, self.param_dtype)

    def _train_dataset(self) -> PackedDataset | MixtureDataset:
        """``data.train_path``'s samples, or the mixture of ``data.sources`` when set."""
        data = self.config.data
        named = [(s["path"], f"data.sources[{i}]") for i, s in enumerate(data.sources)]
        named = named or [(data.train_path, "data.train_path")]
        stores = [self._store(path, key) for path, key in named]
        # Read before the model is built, so that "auto" attention can follow the data.
        self.config.resolve_attention(chat=any(store.chat is not None for store in stores))
        datasets = [self._packed(store, *where) for store, where in zip(stores, named, strict=True)]
        if not data.sources:
            return datasets[0]
        return MixtureDataset(
            datasets,
            [s.get("weight", 1.0) for s in data.sources],
            data.source_names(),
            seed=self.config.training.seed,
            shuffle=data.shuffle,
        )

    def _dataset(self, path: str, key: str) -> PackedDataset:
        """The samples of config key ``key``'s prepared folder or data file (see data.cache)."""
        return self._packed(self._store(path, key), path, key)

    def _store(self, path: str, key: str) -> TokenStore:
        """Config key ``key``'s prepared folder or data file, opened (see data.cache)."""
        data, seq_len = self.config.data, self.config.training.seq_len
        chat = ChatOptions(data.format, data.chat_template, seq_len, data.chat_overlong)
        store = open_token_store(
            sample.resolve(path),
            key,
            sample.resolve(self.config.model.tokenizer_path),
            data.text_field,
            chat=chat,
            is_main=self.parallel_dims.is_main,
            barrier=dist.barrier if self.parallel_dims.world_size > 1 else None,
        )
        if store.chat is not None and self.parallel_dims.is_main:
            counts = store.chat
            logger.info(
                "%s '%s': %d conversations; %d longer than %d tokens truncated, %d dropped "
                "(data.chat_overlong)",
                key,
                path,
                counts["conversations"],
                counts["truncated"],
                counts["max_tokens"],
                counts["dropped"],
            )
        return store

    def _packed(self, store: TokenStore, path: str, key: str) -> PackedDataset:
        """``store``'s samples, with the documents, positions and loss mask the run uses."""
        data = self.config.data
        masked = store.chat is not None and data.chat_loss == "assistant"
        return PackedDataset(
            store,
            self.config.training.seq_len,
            source=f"{key} '{path}'",
            documents=self.config.model.attention == "document",
            positions=data.reset_positions is True,
            loss_mask=masked,
        )

    def _warn_if_schedule_differs(self) -> None:
        """Say what a resumed run whose training.steps changed does: its LR schedule keeps the
        length it was planned for, so that the learning rate never jumps."""
        planned, steps = self.lr_scheduler.total_steps, self.config.training.steps
        if planned == steps:
            return
        if steps > planned:
            first = max(planned, self.step) + 1
            if first > steps:
                return  # nothing left to train
            cfg = self.config.lr_scheduler
            final = self.config.optimizer.lr * lr_factor(torch.tensor(planned), cfg, planned).item()
            what = f"steps {first}-{steps} train at the schedule's final learning rate, {final:.3g}"
            if cfg.decay_type != "constant":
                what += " (min_lr_ratio x lr)"
        else:
            what = f"the run stops at step {steps}, before the learning rate has fully decayed"
        logger.warning(
            "training.steps is %d but the resumed run's LR schedule was planned for %d steps: %s",
            steps,
            planned,
            what,
        )

    def _transform_model(self, model: nn.Module) -> None:
        """Fire the model hooks on the unsharded model, on the meta device: wrap, then compile;
        keep the training loss function they leave (a compiler may compile it)."""
        ctx = ModelContext(
            config=self.config,
            model=model,
            blocks=tuple(model.layers),
            norm=model.norm,
            loss_fn=self.summed_cross_entropy if self.train_data.loss_mask else self.cross_entropy,
            device=self.device,
            param_dtype=self.param_dtype,
            reduce_dtype=self.reduce_dtype,
            parallel_dims=self.parallel_dims,
            name_of=self.host.name_of,
        )
        self.hook.wrap_model(ctx=ctx)
        self.hook.compile_model(ctx=ctx)
        self.loss_fn = ctx.loss_fn
        masked = self.train_data.loss_mask
        # The group only where it is used: on a 2-D mesh its first call creates it.
        group = data_parallel_group(self.parallel_dims) if masked else None
        self.step_loss = StepLoss(masked=masked, group=group)

    def _build_optimizer(self) -> tuple[torch.optim.Optimizer, str]:
        """The optimizer one plugin builds (``build_optimizer``), else the core's fused AdamW,
        and who built it (the plugin's name, or ``core``)."""
        ctx = OptimizerContext(
            config=self.config,
            named_parameters=tuple(self.model.named_parameters()),
            optimizer_config=self.config.optimizer,
            device=self.device,
            parallel_dims=self.parallel_dims,
            name_of=self.host.name_of,
        )
        built = plugin_optimizer(
            self.host.results("build_optimizer", ctx=ctx), self.params, self.device
        )
        if built is None:
            builder, optimizer = (
                "core",
                build_optimizer(self.model, self.config.optimizer, self.device),
            )
        else:
            builder, optimizer = built
        return optimizer, builder

    def _setup_plugins(self) -> None:
        ctx = SetupContext(
            config=self.config,
            model=self.model,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            param_dtype=self.param_dtype,
            reduce_dtype=self.reduce_dtype,
            device=self.device,
            parallel_dims=self.parallel_dims,
            name_of=self.host.name_of,
            export_hf=export_checkpoint,
            control=self.control,
            tokenizer=self.tokenizer,
        )
        self.host.setup(ctx)
        self.metrics.shown = ctx.console
        self.loss_scaler = ctx.loss_scaler
        self.loss_terms = LossTerms.of(self.host)
        if (
            self.param_dtype == torch.float16
            and ctx.loss_scaler is None
            and self.parallel_dims.is_main
        ):
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
        loss_sum = torch.zeros((), device=self.device)
        self.step_loss.start(batch)
        with self.loss_parallel():  # nothing without tensor parallelism
            for ctx.microbatch, microbatch in enumerate(batch):
                targets = microbatch.targets
                logits, loss, lse = self._forward(
                    microbatch,
                    self.loss_fn,
                    with_lse=self.loss_terms is not None,
                    summed=self.train_data.loss_mask,
                )
                loss = self.step_loss(loss, ctx.num_microbatches)
                loss_sum += loss.detach()  # the logged loss: the cross-entropy alone
                if self.loss_terms is not None:  # only in runs where a plugin implements the hook
                    terms = self.host.results(
                        "loss_terms", ctx=self.loss_terms.context(ctx, logits, targets, lse)
                    )
                    loss = self.loss_terms.added_to(loss, terms, ctx)
                del logits, lse  # freed before backward, as the graph keeps only what it needs
                ctx.loss = loss
                lap("fwd_bwd")
                self.hook.pre_backward(ctx=ctx)
                lap("hooks")
                self.sync_replicas(ctx.microbatch == ctx.num_microbatches - 1)
                ctx.loss.backward()
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

    def _forward(
        self,
        microbatch: MicroBatch,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        with_lse: bool = False,
        summed: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """A microbatch's logits, its loss (``loss_fn`` of the logits: the mean cross-entropy,
        or with ``summed`` the sum over the counted tokens) and, ``with_lse``, the logits'
        log-sum-exp for loss terms; with ``model.loss_chunks`` > 1 no logits (None), and the
        loss and log-sum-exp of :class:`ChunkedLoss`."""
        chunks = self.config.model.loss_chunks
        inputs, targets = microbatch.inputs, microbatch.targets
        if chunks == 1:
            logits = self.model(inputs, **microbatch.model_inputs())
            return logits, loss_fn(logits, targets), None
        head = ChunkedLoss(targets, chunks, with_lse=with_lse, summed=summed)
        return None, *self.model(inputs, **microbatch.model_inputs(), head=head)

    def train(self) -> None:
        """Train until ``training.steps``, logging and validating on schedule."""
        cfg = self.config
        if self.step >= cfg.training.steps:
            logger.info(
                "the run in %s is already complete at step %d: nothing to do (to train further, "
                "raise training.steps)",
                cfg.job.dump_folder,
                self.step,
            )
            return
        logger.info(
            "training %s (%.1fM parameters) for %d steps on %d %s process(es), %s compute",
            cfg.model.flavor,
            self.model_spec.num_params(self.model_args) / 1e6,
            cfg.training.steps,
            self.parallel_dims.world_size,
            self.device.type,
            cfg.training.mixed_precision_param,
        )
        estimate = estimate_run(cfg, self.parallel_dims.world_size, self.model_args.vocab_size)
        logger.info("memory estimate per process: %s", estimate.summary())
        logger.info(
            "optimizer (%s): %s", self.optimizer_builder, describe_param_groups(self.optimizer)
        )
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
            if self.val_data is not None and self._due(cfg.validation.interval, self.step):
                self.metrics.log({"step": self.step, **self.validate()})
            signal = self.stop.vote()
            stop = signal.name if signal is not None else self.control.requested_stop
            self.checkpointer.after_step(self.step, stop is not None)
            if self.requests.after_step():
                # The steps after the checkpoint rewound to are undone: so are their records.
                self.metrics.start(self.step)
            if stop is not None:
                self._log_stop(stop)
                break

    def _log_stop(self, cause: str) -> None:
        if self.step == self.config.training.steps:
            return  # the run is complete anyway
        if self.config.checkpoint.enable:
            then = "run the same command to resume"
        else:
            then = "checkpoint.enable is off, so nothing was saved and a rerun starts afresh"
        logger.info("stopped after step %d on %s; %s", self.step, cause, then)

    def _due(self, every: int, step: int) -> bool:
        return step % every == 0 or step == self.config.training.steps

    def _log_step(self, loss: torch.Tensor, ctx: StepContext, lr: torch.Tensor) -> None:
        """Read the step's numbers from the device (the one host sync of a logging step)."""
        times = self.timer.window()
        global_loss = all_reduce_mean(loss, self.parallel_dims.world_size)
        record = {"step": self.step, "loss": to_number(global_loss), "lr": to_number(lr)}
        for plugin, metrics in self.host.results("step_metrics", ctx=ctx).items():
            record.update({f"{plugin}/{k}": to_number(v) for k, v in metrics.items()})
        if self.loss_terms is not None:
            record.update(self.loss_terms.metrics(self.parallel_dims.world_size))
        train_cfg = self.config.training
        record.update(
            throughput(
                train_cfg.batch_size * train_cfg.seq_len,
                times["time_step_s"],
                self.parallel_dims.world_size,
                self.model_spec.flops_per_token(self.model_args, train_cfg.seq_len),
                self.peak_tflops,
                self.matmul_step_seconds,
            ),
            **times,
            memory_gib=peak_memory_gib(self.device),
            skipped_steps=int(self.vetoes.total),
        )
        record.update({f"skipped_steps.{k}": int(v) for k, v in self.vetoes.by_plugin.items()})
        if isinstance(self.train_data, MixtureDataset):
            record.update(self.train_data.shares())
        self.metrics.log(record)

    def validate(self) -> dict[str, float | str]:
        """The validation losses: ``validation_loss`` and ``validation_bpb`` on the model's
        weights, then ``<name>/validation_loss`` and ``<name>/validation_bpb`` for each weight set
        a plugin offers (``validation_weights``), each pass between ``pre_validation`` and
        ``post_validation``; and what plugins report from ``validation_metrics``
        (``<plugin>/<key>``, ``<name>/<plugin>/<key>`` for a weight set)."""
        offered = self.host.results("validation_weights").values()
        losses: dict[str, float | str] = {}
        for weights in [None, *(name for names in offered for name in names)]:
            ctx = ValidationContext(self.step, weights)
            self.hook.pre_validation(ctx=ctx)
            ctx.loss, bpb = self._validation_loss()
            # While the pass's weights are in place, whatever order the plugins are in.
            metrics = self.host.results("validation_metrics", ctx=ctx)
            # FSDP2 keeps the root's and last block's parameters unsharded after a forward
            # without backward (this pass's, a plugin's): the next would reuse them, missing
            # the weights a plugin swaps in or back.
            reshard(self.model)
            self.hook.post_validation(ctx=ctx)
            prefix = "" if weights is None else f"{weights}/"
            losses[f"{prefix}validation_loss"] = ctx.loss
            losses[f"{prefix}validation_bpb"] = bpb
            for plugin, values in metrics.items():
                losses.update(
                    {
                        f"{prefix}{plugin}/{key}": v if isinstance(v, str) else to_number(v)
                        for key, v in values.items()
                    }
                )
        return losses

    @torch.no_grad()
    def _validation_loss(self) -> tuple[float, float]:
        """Mean validation loss over ``validation.steps`` batches, averaged over ranks, and the
        bits per byte: the summed loss over ln 2 and the UTF-8 bytes the targets stand for.
        With a loss mask, the mean over the counted targets of all the batches and ranks."""
        assert self.val_data is not None
        self.model.eval()
        total = torch.zeros(2, device=self.device)  # the batches' mean losses, and their count
        scored = torch.zeros(2, dtype=torch.float64, device=self.device)  # nats, bytes
        for microbatch in iter_eval_batches(
            self.val_data,
            batch_size=self.config.training.batch_size,
            rank=self.parallel_dims.dp_rank,
            world_size=self.parallel_dims.dp_size,
            max_batches=self.config.validation.steps,
        ):
            microbatch = microbatch.to(self.device)
            targets = microbatch.targets
            # The training forward's masking, positions and chunks: the same loss for the text.
            with self.loss_parallel():
                masked = self.val_data.loss_mask
                loss_fn = self.summed_cross_entropy if masked else self.cross_entropy
                loss = self._forward(microbatch, loss_fn, summed=masked)[1]
            if masked:  # the loss over the counted tokens, as in training
                counted = targets != IGNORE_INDEX
                total[0] += loss
                total[1] += counted.sum()
                scored[0] += loss.double()
                scored[1] += (self.token_bytes[targets.clamp(min=0)] * counted).sum()
                continue
            total[0] += loss
            total[1] += 1
            scored[0] += loss.double() * targets.numel()
            scored[1] += self.token_bytes[targets].sum()
        self.model.train()
        # One reduction for both, in float64; rounded back to float32, the loss sums are those
        # of a float32 reduction (bitwise on 1 and 2 ranks: 53 bits >= 2 x 24 + 2).
        reduced = all_reduce_mean(
            torch.cat([total.double(), scored]), self.parallel_dims.world_size
        )
        total, (nats, num_bytes) = reduced[:2].float(), reduced[2:]
        bits_per_byte = nats / (math.log(2) * num_bytes)
        loss, bpb = torch.stack([(total[0] / total[1]).double(), bits_per_byte]).tolist()
        return loss, bpb  # one read of the device, as before

    def run(self) -> None:
        """Train, then :meth:`close`; on any error :meth:`abort` instead, and re-raise.

        No collective (no barrier) on the way out of an error: the other ranks may be blocked
        in one that this rank will never join.
        """
        try:
            self.train()
            self.close()
        except BaseException:
            self.abort()
            raise

    def close(self) -> None:
        """End the run: finish a save in flight (collective), then as :meth:`abort`. The
        process group is left to the launcher."""
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
