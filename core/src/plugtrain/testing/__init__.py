"""The plugin author's test kit: tiny real runs, contexts, fault injection and cost checks.

Installing plugtrain registers :mod:`plugtrain.testing.pytest_plugin` as a pytest plugin (the
``pytest11`` entry point ``plugtrain``), so a plugin's own repository gets its fixtures with no
``conftest.py``; loading it imports no torch. The functions are imported from this package as
usual (``from plugtrain.testing import tiny_run``), which imports the module that holds each
one when it is first asked for. A plugin's tests need nothing else from the core than
:mod:`plugtrain.plugin` and this package; pytest comes with the ``testing`` extra.

Runs (:mod:`~plugtrain.testing.runs`, :mod:`~plugtrain.testing.processes`):

* :func:`tiny_run` trains the tiny model for a few steps on the shipped sample (1 or more
  processes over gloo) with given plugins and config overrides, and returns a :class:`RunResult`:
  per-step losses, the metrics records, each rank's parameter checksum, the hooks fired in
  order and the skipped steps. The ``plugtrain_run`` fixture is the same, in ``tmp_path``.
* :func:`make_trainer` builds the :class:`Trainer` of such a run for tests that drive it
  themselves; :func:`tiny_args` are its command-line arguments; its ``loss.fn`` is its
  loss, for a reference loop written out. :class:`GradNorms` keeps a run's grad norms by step
  on each rank, :func:`copy_checkpoint` seeds a run to resume from another's checkpoint, and
  :func:`relative` compares two numbers, for runs checked against one process; :data:`CHAT`
  are the arguments of a run on the sample's chat data.
* :func:`run_distributed` calls a function on N spawned ranks; :func:`run_script` runs a
  training script as a user would (python, or torchrun for several processes).

Unit tests of one hook (:mod:`~plugtrain.testing.contexts`): :func:`step_context`,
:func:`setup_context`, :func:`model_context` and :func:`convert_context` build real contexts.

Faults (:mod:`~plugtrain.testing.faults`): :class:`InjectInf` puts inf into the loss or one
rank's gradients at given steps (:func:`poison` does it by hand); :class:`PoisonBatches` makes
given batches spike; :class:`SigtermAt` stops a
run with SIGTERM on one rank, and :func:`interrupted_and_resumed` checks that a stopped run
resumes exactly.

Checks (:mod:`~plugtrain.testing.checks`): :func:`count_costs` and :func:`assert_costs` (host
syncs, collectives and time per non-logging step, of the whole step or of one plugin's hooks);
:func:`check_order_independence` (the same parameters bitwise whatever the plugin's position
among the enabled plugins); :class:`StepWatcher`, :class:`PeakMemory` and
:func:`saved_activation_bytes` (the bytes a training forward keeps for its backward).

Hugging Face folders (:mod:`~plugtrain.testing.hf`, with transformers installed):
:func:`hf_llama_folder` saves a tiny random ``LlamaForCausalLM`` (plain, tied or RoPE-scaled,
sharded on request) as transformers does; :func:`hf_llama_logits` is transformers' logits for
it, the reference of an import; :func:`save_random_llama` saves one of a plugtrain shape.

The reference data path (:mod:`~plugtrain.testing.reference`): :func:`load_jsonl_texts`,
:func:`tokenize_documents`, :class:`InMemoryStream` and :func:`build_dataset` read, frame and
pack a JSONL file in memory, the oracle that prepared data is checked against;
:func:`packed_documents` and :func:`document_spans` pack random documents into rows and find
them again, the oracle of document masking; :func:`stored_documents` reads each document of a
prepared folder back.

The hand-written recipes (:mod:`~plugtrain.testing.recipes`): :func:`canonical_fp16_loop` is
the canonical ``torch.amp.GradScaler`` loop (clipping optional) on a trainer's model, on its
device, that the ``grad_scaler`` plugin must equal bit for bit; :func:`grad_norm` reads a
model's global gradient norm.

Object storage (:mod:`~plugtrain.testing.s3`, with ``moto[server]`` and s3fs installed):
:class:`S3Server` is a real S3 server on the loopback address, with a bucket and test
credentials; the ``s3_server`` fixture is one for a test module, its environment set.

Plugin objects handed to a multi-process run are pickled into spawned processes: define their
classes at module level. Functions handed to :func:`run_distributed` must be module level too,
in any module, test files included (a module that is not importable by name, as pytest's
``importlib`` mode leaves test files, is loaded from its file in each rank).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from plugtrain.testing.checks import Costs as Costs
    from plugtrain.testing.checks import PeakMemory as PeakMemory
    from plugtrain.testing.checks import StepWatcher as StepWatcher
    from plugtrain.testing.checks import assert_costs as assert_costs
    from plugtrain.testing.checks import check_order_independence as check_order_independence
    from plugtrain.testing.checks import count_costs as count_costs
    from plugtrain.testing.checks import saved_activation_bytes as saved_activation_bytes
    from plugtrain.testing.contexts import convert_context as convert_context
    from plugtrain.testing.contexts import model_context as model_context
    from plugtrain.testing.contexts import setup_context as setup_context
    from plugtrain.testing.contexts import step_context as step_context
    from plugtrain.testing.faults import InjectInf as InjectInf
    from plugtrain.testing.faults import PoisonBatches as PoisonBatches
    from plugtrain.testing.faults import SigtermAt as SigtermAt
    from plugtrain.testing.faults import interrupted_and_resumed as interrupted_and_resumed
    from plugtrain.testing.faults import poison as poison
    from plugtrain.testing.hf import HF_VARIANTS as HF_VARIANTS
    from plugtrain.testing.hf import hf_llama_config as hf_llama_config
    from plugtrain.testing.hf import hf_llama_folder as hf_llama_folder
    from plugtrain.testing.hf import hf_llama_logits as hf_llama_logits
    from plugtrain.testing.hf import hf_logits as hf_logits
    from plugtrain.testing.hf import hf_qwen3_moe_config as hf_qwen3_moe_config
    from plugtrain.testing.hf import hf_qwen3_moe_folder as hf_qwen3_moe_folder
    from plugtrain.testing.hf import hf_tensors as hf_tensors
    from plugtrain.testing.hf import save_random_llama as save_random_llama
    from plugtrain.testing.processes import free_port as free_port
    from plugtrain.testing.processes import run_distributed as run_distributed
    from plugtrain.testing.processes import run_script as run_script
    from plugtrain.testing.pytest_plugin import plugtrain_run as plugtrain_run
    from plugtrain.testing.recipes import RecipeResult as RecipeResult
    from plugtrain.testing.recipes import canonical_fp16_loop as canonical_fp16_loop
    from plugtrain.testing.recipes import grad_norm as grad_norm
    from plugtrain.testing.reference import InMemoryStream as InMemoryStream
    from plugtrain.testing.reference import build_dataset as build_dataset
    from plugtrain.testing.reference import document_spans as document_spans
    from plugtrain.testing.reference import load_jsonl_texts as load_jsonl_texts
    from plugtrain.testing.reference import packed_documents as packed_documents
    from plugtrain.testing.reference import stored_documents as stored_documents
    from plugtrain.testing.reference import tokenize_documents as tokenize_documents
    from plugtrain.testing.runs import CHAT as CHAT
    from plugtrain.testing.runs import SAMPLE as SAMPLE
    from plugtrain.testing.runs import GradNorms as GradNorms
    from plugtrain.testing.runs import HookLog as HookLog
    from plugtrain.testing.runs import RunResult as RunResult
    from plugtrain.testing.runs import Trainer as Trainer
    from plugtrain.testing.runs import copy_checkpoint as copy_checkpoint
    from plugtrain.testing.runs import make_trainer as make_trainer
    from plugtrain.testing.runs import max_difference as max_difference
    from plugtrain.testing.runs import metrics_by_step as metrics_by_step
    from plugtrain.testing.runs import parameter_checksums as parameter_checksums
    from plugtrain.testing.runs import read_metrics as read_metrics
    from plugtrain.testing.runs import relative as relative
    from plugtrain.testing.runs import tiny_args as tiny_args
    from plugtrain.testing.runs import tiny_run as tiny_run
    from plugtrain.testing.s3 import S3Server as S3Server
    from plugtrain.testing.storage import SMALL_RUN_CONFIG as SMALL_RUN_CONFIG
    from plugtrain.testing.storage import SMALL_TEMPLATE as SMALL_TEMPLATE
    from plugtrain.testing.storage import save_small_checkpoint as save_small_checkpoint
else:
    from plugtrain.exports import front_door

    __getattr__, __dir__, __all__ = front_door(__name__, __file__)
