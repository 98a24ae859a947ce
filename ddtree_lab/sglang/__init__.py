"""SGLang interop, one module per job; none imports sglang until one of its kernels is run.

* :mod:`.buffers` -- SGLang's verify layout: :func:`to_sglang_buffers`,
  :func:`from_sglang_buffers`, :class:`SGLangVerifyBuffers`, :class:`TreeMaskMode`, the tree
  mask modes, :func:`verify_output_to_sglang` / :func:`verify_output_from_sglang`, and
  :func:`find_sglang_buffer_problems` (the buffer checks);
* :mod:`.kernels` -- SGLang's own kernels on lab inputs (:func:`sglang_verify_greedy`,
  :func:`sglang_verify_chain`, :func:`sglang_verify_target_only`, :func:`sglang_build_tree`)
  and the lab's verifiers by backend (:func:`lab_verifiers`);
* :mod:`.recorder` -- :class:`SGLangRecorder` (wrapping, the import hook);
* :mod:`.environment` -- the environment switch :func:`install_from_env` and :func:`hook_dir`
  for ``PYTHONPATH``;
* :mod:`.append` -- the append-only recording file (:class:`~.append.AppendSink`: a call's
  inputs before its kernel runs, outputs after; calls that did not return are kept and can be
  checked and replayed, :func:`~.pending.replay_pending`);
* :mod:`.recording` -- the recording file (:func:`save_recording`, :func:`load_recording`,
  checksummed), lab objects from one recorded row (:func:`step_parts`,
  :func:`step_verify_input`) and the doctor's check of a recording (:func:`recording_problems`);
* :mod:`.replay` -- :func:`replay_recording` with any lab backend, :func:`recording_to_trace`
  (lab traces, which the lab's views draw), and the command-line function
  :func:`replay_report` (``ddtree_lab.io.convert`` writes a recording as a lab trace).
"""

from .buffers import SGLangVerifyBuffers as SGLangVerifyBuffers
from .buffers import TreeMaskMode as TreeMaskMode
from .buffers import find_sglang_buffer_problem as find_sglang_buffer_problem
from .buffers import find_sglang_buffer_problems as find_sglang_buffer_problems
from .buffers import from_sglang_buffers as from_sglang_buffers
from .buffers import to_sglang_buffers as to_sglang_buffers
from .buffers import verify_input_from_retrieve as verify_input_from_retrieve
from .buffers import verify_output_from_sglang as verify_output_from_sglang
from .buffers import verify_output_to_sglang as verify_output_to_sglang
from .kernels import lab_verifiers as lab_verifiers
from .kernels import sglang_kernels as sglang_kernels
from .kernels import sglang_unavailable_reason as sglang_unavailable_reason
from .recorder import RecordFilter as RecordFilter
from .recorder import SGLangRecorder as SGLangRecorder
from .environment import hook_dir as hook_dir
from .environment import install_from_env as install_from_env
from .recording import Recording as Recording
from .recording import RecordingFormatError as RecordingFormatError
from .recording import load_recording as load_recording
from .recording import recording_problems as recording_problems
from .recording import save_recording as save_recording
from .recording import step_parts as step_parts
from .recording import step_verify_input as step_verify_input
from .replay import ReplayResult as ReplayResult
from .replay import count_verdicts as count_verdicts
from .replay import recording_to_trace as recording_to_trace
from .replay import replay_recording as replay_recording
from .replay import replay_report as replay_report
