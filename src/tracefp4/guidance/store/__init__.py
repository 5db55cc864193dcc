"""The guidance store: rollout records that cross process (and machine) boundaries.

Rollout workers (writers) record, per trajectory, the TRACE guidance of every guided site and the
routed expert indices; the trainer (reader) reads them back for its training batch. This module is
plain files on a (possibly shared) file system: safetensors shards plus JSON manifests, no pickle
anywhere.

Layout of one RL step::

    root/step-00000012/
        w0-00000.safetensors      # shard: keys "{traj_id}/{tensor_name}" and "{traj_id}/policy_version"
        w0-00001.safetensors
        w0.manifest.json          # per writer, published last, never replaced
        w1-00000.safetensors
        w1.lock                   # only while writer w1 is writing
        w1.manifest.json
        COMPLETE.json             # seal, written by the driver once all writers returned

Record
    One trajectory's record is ``dict[str, Tensor]``; every tensor has leading dim ``T`` = number of
    token positions (prompt + completion). Names are ``L{layer:02d}.{site}.{field}`` for guidance
    (site in :class:`~tracefp4.guidance.names.Site`) and ``L{layer:02d}.routing`` for the routed expert
    indices (routing replay travels in the same store; it is just one more tensor).

Versions and contract (format 3)
    Each row of a record carries the policy version of the weights that computed it:
    ``StoreWriter.add(..., versions=)`` (an integer ``[T]``; None: every row at the writer's
    ``policy_version``), kept as int64 ``[T]`` under the shard key ``{traj_id}/policy_version`` (not a
    record name, so never returned as a record tensor; covered by the trajectory's hash), and
    ``StoreReader.versions(traj_id)``. The manifest lists each trajectory's ``[oldest, newest]`` and,
    as its ``policy_version``, the newest row; the seal the step's newest (``policy_version``) and
    oldest (``oldest_policy_version``): writers of one step may hold different versions. Every
    manifest and the seal carry the records' quantizer contract (a one-line id,
    :func:`tracefp4.engines.contract.quantizer_contract`), on which a step's writers must agree. A
    reader at version v with ``max_lag=k`` accepts rows of versions v-k .. v (default k = 0: its own
    version only) and, given a ``contract``, refuses another one naming both.

Decisions (and why)
    * **Visibility without replacement.** Every shard, manifest and seal is written to a hidden
      temp file in the step folder, fsynced, then published with ``link(tmp, name)``, which fails
      if ``name`` exists, and the folder fsynced. A reader therefore sees either no file or a
      complete one, and no published file is ever replaced by a later write. A writer's manifest
      is published after all of its shards; ``COMPLETE.json`` by :func:`seal_step` after all
      manifests. Readers refuse a step without ``COMPLETE.json``, so a half-written step is
      never visible, even if a worker died after some manifests landed. (The file system must
      support hard links; local file systems, NFS and Lustre do.)
    * **One writer per name.** Writers of one step do not coordinate: each only creates files
      whose names start with its own ``writer_id`` (shards ``{writer_id}-{seq:05d}.safetensors``,
      its manifest, its lock and its temp files). A second writer of the *same* name is refused:
      at creation, by an exclusive lock file ``{writer_id}.lock`` (``O_CREAT|O_EXCL``, holding
      pid, host and a random token), and again before every publish, which checks that the lock
      still holds this writer's token and that the step folder is still the one it opened; the
      manifest's ``link`` refuses to replace a manifest that appeared meanwhile. The lock is
      removed once the manifest is published (a finished writer is then refused because its
      manifest exists). The shard sequence number is capped at 99999 so the fixed-width suffix
      makes the writer id recoverable from a shard name.
    * **Checksums, hierarchically, verified on the bytes that are used.** The seal records the
      sha256 of each manifest; a manifest records, per shard, its size and sha256 and the sha256
      of its safetensors header (the 8-byte length and the JSON header), and, per trajectory, the
      sha256 of its tensor bytes (each tensor's data range, concatenated in sorted tensor-name
      order). The hashes are computed over the exact bytes written (``safetensors.torch.save`` to
      memory, then one write). A reader opens each shard once (``O_NOFOLLOW``), keeps the file
      descriptor, checks the size (so a truncation is reported as a truncation), reads the header
      with ``pread``, checks its hash and that it agrees with the manifest (keys, dtypes, shapes,
      contiguous data offsets); :meth:`StoreReader.get` reads exactly that trajectory's byte
      ranges from the same descriptor (``preadv``), checks their hash and builds the tensors from
      those verified bytes. Every byte a reader returns was verified after it was read, from the
      file whose header it verified: a file swapped in by path after opening is never read, and a
      byte changed in place is caught by the trajectory hash. :meth:`StoreReader.verify` hashes
      whole shards through the same descriptors.
    * **Rank-local reads.** Because trajectories are verified individually, a reader reads only
      the shard headers and the trajectories it is asked for; ``StoreReader.bytes_read`` counts
      those bytes (plus whole shards hashed by ``verify()``), to be reported per rank beside the
      step's size (:func:`step_bytes`) or its payload (``bytes_per_token(...)['total_bytes']``).
    * **Strictness.** Every disagreement is a :class:`StoreError` that names what and where (path,
      step, writer, trajectory id, tensor name): unknown trajectory, length, trailing shape, dtype,
      model signature, policy version or lag, quantizer contract, out-of-range position slice,
      duplicate trajectory id, duplicate JSON keys, malformed JSON of any kind (including nesting too
      deep to decode), a manifest or seal of another format version. Nothing is ever clipped, padded or skipped
      silently.
    * **No links followed.** A step folder, shard, manifest, seal or lock that is a symbolic link
      (or not a regular file) is an error, never followed: step folders are opened with
      ``O_DIRECTORY|O_NOFOLLOW`` and every file relative to that descriptor with ``O_NOFOLLOW``.
      Only ``root`` itself is taken as given.
    * **One trajectory, one shard.** A record is never split over shards, so reading a trajectory
      touches one file. A record larger than ``shard_bytes`` gets a shard of its own.
    * **Aborted and dead writers.** If the writer's ``with`` block raises, the manifest is not
      written and the shards it already published are removed, with its lock. A writer killed
      outright (SIGKILL, node loss) leaves temp files, unreferenced shards and its lock behind;
      readers never open them (they only open shards listed in a sealed manifest), and
      :func:`seal_step` removes everything in the step folder that is not a sealed writer's
      manifest or shard or the seal. Its stale lock refuses a retry under the same name in that
      step; :func:`discard_step` removes a whole step (sealed or half-written) so that a run
      resumed after a crash can redo it.
    * **Extra manifests.** :func:`seal_step` seals exactly the writers the driver names; the
      files of any other writer (e.g. a worker that was given up on but finished late) are
      removed when sealing, and that writer's ``close()`` fails. The driver, not the file
      system, decides what a step contains.
    * **Discarding.** :func:`discard_step` renames the step folder to a hidden tombstone name
      inside ``root`` (atomic: the step is gone for everyone at once), fsyncs ``root``, then
      deletes the tombstone without following links; an interrupted discard is finished by the
      next call. A writer still writing into a discarded step fails at its next publish.
    * **Canonical names.** Layer numbers must be written exactly as ``{layer:02d}`` so that two
      spellings (``L7`` / ``L07`` / ``L007``) can never alias the same layer.
    * **Dtypes.** All dtypes safetensors round-trips bit-exactly: bool, (u)int8..64, float16,
      bfloat16, float32, float64, float8_e4m3fn, float8_e5m2, float8_e8m0fnu. ``float4_e2m1fn_x2``
      is refused: safetensors 0.8 writes it with the unpacked element count in the shape and cannot
      load it back. Store packed FP4 codes as ``uint8`` (``t.view(torch.uint8)``), which is the same
      bytes. Routing indices must have an integer dtype. Data is little-endian (safetensors'
      byte order); readers on big-endian hosts are refused.
    * **Versions.** Manifests and seals carry :data:`FORMAT_VERSION` (3: per-token policy versions
      and the quantizer contract). Format 2 (header and per-trajectory hashes, one policy version per
      step) is still read (:data:`READABLE_VERSIONS`), as version-uniform: every row at the step's
      ``policy_version``, which is what format 2 meant (one version per step, on which every writer
      had to agree at sealing); it has no contract, so a reader given one refuses it (naming that),
      and this code does not seal a format-2 step. Other versions, including version 1 (whole-shard
      hashes only), are refused with a message saying so; such a step has to be written again.
    * **Byte-identical shards.** safetensors writes the header's ``__metadata__`` from a hash map
      seeded per process; the writer rewrites those entries in sorted key order (the tensor entries
      already have a fixed order), so two processes writing the same records write the same shard
      and manifest bytes.
    * **Positions.** :meth:`StoreReader.get` takes a step-1 slice with ``0 <= start <= stop <= T``;
      negative or out-of-range bounds are an error instead of Python's silent clipping. The whole
      trajectory is read (its hash covers all of it) and then sliced.
    * **Accounting** (:func:`bytes_per_token`) counts tensor payload bytes (numel x itemsize, from
      the manifest metadata; safetensors headers, the per-token versions and file-system overhead
      excluded) over all
      recorded positions, divided by the number of *generated* tokens (``T - prompt_len``
      summed), which is the unit the paper's bytes-per-token figures use. :func:`step_bytes` is
      the size of the step's shard files, headers included.
    * Parts: :mod:`.common` (names, limits, errors, file primitives), :mod:`.manifest`, :mod:`.writer`,
      :mod:`.seal` (seal and discard), :mod:`.reader`, :mod:`.accounting`.
    * A reader holds one open file descriptor per shard it has used (and one for the step folder)
      until :meth:`StoreReader.close`; it is not thread-safe: use one reader per thread or
      process.
"""

from __future__ import annotations

from tracefp4.guidance.store.common import (
    COMPLETE_NAME,
    FORMAT_VERSION,
    LOCK_SUFFIX,
    READABLE_VERSIONS,
    ROUTING,
    SUPPORTED_DTYPES,
    VERSIONS_KEY,
    StoreError,
    parse_name,
    step_dir,
)
from tracefp4.guidance.store.manifest import TensorMeta, TrajectoryMeta, ShardMeta, Manifest
from tracefp4.guidance.store.writer import StoreWriter
from tracefp4.guidance.store.seal import seal_step, discard_step, discard_steps
from tracefp4.guidance.store.reader import StoreReader
from tracefp4.guidance.store.accounting import bytes_per_token, step_bytes

__all__ = [
    "COMPLETE_NAME",
    "FORMAT_VERSION",
    "LOCK_SUFFIX",
    "READABLE_VERSIONS",
    "ROUTING",
    "SUPPORTED_DTYPES",
    "VERSIONS_KEY",
    "StoreError",
    "TensorMeta",
    "TrajectoryMeta",
    "ShardMeta",
    "Manifest",
    "parse_name",
    "step_dir",
    "StoreWriter",
    "seal_step",
    "discard_step",
    "discard_steps",
    "StoreReader",
    "bytes_per_token",
    "step_bytes",
]
