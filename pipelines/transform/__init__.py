"""The training step's passes, one per file, each named after its file; pipelines/compile.py puts
them in order. Each docstring opens with the rewrite it does and shows the IR before and after.
"""
from pipelines.transform.bool_ops_as_ints import BoolOpsAsInts
from pipelines.transform.chunk_loss_rows import ChunkLossRows
from pipelines.transform.collapse_reshapes import CollapseReshapes
from pipelines.transform.empty_constants import EmptyConstantsAsZeros
from pipelines.transform.fold_constant_reshapes import FoldConstantReshapes
from pipelines.transform.flatten_take_indices import FlattenTakeIndices
from pipelines.transform.freeze_statistics import FreezeStatistics
from pipelines.transform.frozen_norms_elementwise import FrozenNormsElementwise
from pipelines.transform.fuse_softmax_cross_entropy import FuseSoftmaxCrossEntropy
from pipelines.transform.isolate_gemms import IsolateGemms
from pipelines.transform.loss_gradient_in_place import LossGradientInPlace
from pipelines.transform.max_pool_grad_in_bounds import MaxPoolGradInBounds
from pipelines.transform.non_finite_fills import NonFiniteFills
from pipelines.transform.plain_powers import PlainPowers
from pipelines.transform.prune_frozen import PruneFrozenUpdates
from pipelines.transform.recompute import RecomputeActivations
from pipelines.transform.reorder_updates import ReorderUpdates
from pipelines.transform.slice_channels import SliceChannelUpdates
from pipelines.transform.split_as_slices import SplitAsSlices
from pipelines.transform.store_frozen_weights import StoreFrozenWeights
from pipelines.transform.update_in_place import UpdateInPlace

__all__ = ["BoolOpsAsInts", "ChunkLossRows", "CollapseReshapes", "EmptyConstantsAsZeros",
           "FlattenTakeIndices", "FoldConstantReshapes", "FreezeStatistics",
           "FrozenNormsElementwise", "FuseSoftmaxCrossEntropy", "IsolateGemms",
           "LossGradientInPlace", "MaxPoolGradInBounds", "NonFiniteFills", "PlainPowers",
           "PruneFrozenUpdates", "RecomputeActivations", "ReorderUpdates", "SliceChannelUpdates",
           "SplitAsSlices", "StoreFrozenWeights", "UpdateInPlace"]
