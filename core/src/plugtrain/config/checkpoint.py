"""The [checkpoint] section: saving checkpoints, resuming from them, and the initial load."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from plugtrain.errors import check_field


@dataclass
class CheckpointConfig:
    """Saving checkpoints and resuming from them."""

    enable: bool = False
    """Save checkpoints to ``<job.dump_folder>/checkpoints/step-<N>/`` and resume from them: a
    run started again with the same dump folder continues where the last complete one left off."""
    save_final: bool = True
    """Save the run's last step (``training.steps``) even with ``enable`` off: a checkpoint like
    the others (the model and all a resume needs), which ``plugtrain generate``, ``export-hf``
    and ``eval`` read from the dump folder. With ``enable`` off a run stopped early saves
    nothing, and a dump folder that already holds checkpoints is refused at start-up (resume
    from them with ``enable``, train in another folder, or delete them with
    ``discard_later``)."""
    interval: int = 500
    """Save every this many steps; a run also saves at its last step and when it stops on
    SIGTERM or SIGINT."""
    keep_latest_k: int = 3
    """Keep the newest this many complete checkpoints, deleting older ones after each save; 0
    keeps every one."""
    load_step: int = -1
    """Checkpoint to resume from: -1 the latest complete one (none: train from scratch), N the
    one of step N (an error if it does not exist), 0 none (train from scratch). N or 0 in a
    folder holding later complete checkpoints is an error, unless ``discard_later`` is set."""
    discard_later: bool = False
    """Delete, at start-up, the complete checkpoints after the one ``load_step`` picks (with
    ``load_step`` 0, or ``enable`` off and ``save_final`` on: all of them), written by an earlier
    run; without it such a start is refused, since this run would overwrite them."""
    async_mode: Literal["disabled", "async"] = "disabled"
    """``async``: copy the state to CPU memory, then write it in a background thread while
    training goes on (``dcp.async_save``); ``disabled``: training waits for each save."""
    initial_load_path: str = ""
    """Start a new run from these weights instead of random ones: a Hugging Face Llama folder
    (``config.json`` and ``model.safetensors``, sharded or not; its ``tokenizer.json`` is used
    unless ``model.tokenizer_path`` is set) or a plugtrain ``step-N`` checkpoint folder. Ignored
    when the dump folder holds checkpoints: the run then resumes from them. ``model.flavor``
    must have the loaded model's shape."""
    endpoint_url: str = ""
    """With ``job.dump_folder`` an ``s3://`` URL: the endpoint of an S3-compatible store
    (``http://127.0.0.1:9000``); empty: botocore's own choice (``AWS_ENDPOINT_URL_S3``,
    ``AWS_ENDPOINT_URL``, else AWS). Credentials always come from the AWS chain, never here."""
    store_retries: int = 3
    """With ``job.dump_folder`` a URL: how many times an upload, copy or removal that fails is
    tried again (waiting 0.5 s, then twice as long each time) before the save fails."""
    initial_load_model_only: bool = True
    """With ``initial_load_path`` a plugtrain checkpoint: false takes AdamW's state (moments and
    its step count) too, e.g. to branch a decay run from a stable-phase checkpoint. The step,
    LR schedule and data position always start afresh with this run's settings."""

    def __post_init__(self) -> None:
        check_field(self.interval >= 1, "interval", f"must be >= 1, got {self.interval}")
        check_field(
            self.keep_latest_k >= 0,
            "keep_latest_k",
            f"must be >= 0 (0 keeps all), got {self.keep_latest_k}",
        )
        check_field(
            self.load_step >= -1,
            "load_step",
            f"must be -1 (latest), 0 (none) or a step, got {self.load_step}",
        )
        check_field(
            self.enable or self.load_step == -1,
            "load_step",
            "needs checkpoint.enable = true: add --checkpoint.enable true",
        )
        check_field(
            self.enable or self.save_final or not self.discard_later,
            "discard_later",
            "deletes nothing with checkpoint.enable and checkpoint.save_final off: add "
            "--checkpoint.enable true",
        )
        check_field(
            self.store_retries >= 0, "store_retries", f"must be >= 0, got {self.store_retries}"
        )
        check_field(
            self.initial_load_model_only or bool(self.initial_load_path),
            "initial_load_model_only",
            "false needs checkpoint.initial_load_path: set it to a step-N folder",
        )
