"""The torch ops discovery tells apart by name: adds, views, scales, products, softmaxes, fused
attention, and those that only read a tensor's shape."""

from __future__ import annotations

ADD_OPS = frozenset({"add", "add_", "__add__", "__radd__", "__iadd__"})
# Ops whose output holds the same values as their input (a residual read through them is exact).
EXACT_VIEW_OPS = frozenset(
    {
        "view",
        "reshape",
        "view_as",
        "reshape_as",
        "permute",
        "transpose",
        "t",
        "contiguous",
        "clone",
        "detach",
        "flatten",
        "squeeze",
        "unsqueeze",
        "to",
        "float",
        "type_as",
        "type",
        "as_tensor",  # of a tensor: that tensor itself (MONAI's HighResBlock skip)
        "asarray",
    }
)
# Tensor properties read as ops (``__get__``), by the op they amount to: ``x.data`` is ``x``
# cut from autograd (MONAI's zero-padded shortcut, ``torch.cat([out.data, pad])``).
PROPERTY_OPS = {"data": "detach", "T": "permute", "mT": "transpose"}
# Ops looked through when deciding what an operand derives from, but not value-preserving.
PASS_OPS = frozenset(
    {"dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d"}
)
SCALE_OPS = frozenset({"mul", "__mul__", "__rmul__", "div", "__truediv__", "mul_", "__imul__"})
MATMUL_OPS = frozenset({"matmul", "__matmul__", "bmm", "einsum", "baddbmm"})
# Ops that apply a parameter as a weight (a matrix, kernel or table), whatever view of it.
WEIGHT_OPS = frozenset(
    {
        "linear",
        "bilinear",
        "conv1d",
        "conv2d",
        "conv3d",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
        "matmul",
        "__matmul__",
        "__rmatmul__",
        "mm",
        "bmm",
        "addmm",
        "addbmm",
        "baddbmm",
        "einsum",
        "tensordot",
        "embedding",
        "embedding_bag",
        # a stack of expert matrices applied to groups of rows (transformers' grouped_mm experts)
        "grouped_mm",
        "_grouped_mm",
        "grouped_mm_fallback",
    }
)
# nn.MultiheadAttention's functional forms: what they write comes through ``out_proj_weight``.
MHA_OPS = {"multi_head_attention_forward": 11, "_native_multi_head_attention": 7}
SOFTMAX_OPS = frozenset({"softmax", "_softmax", "special_softmax"})
# Ops whose output takes only the shape (and dtype) of their input, none of its values.
SHAPE_ONLY_OPS = frozenset(
    {
        "zeros_like",
        "ones_like",
        "empty_like",
        "full_like",
        "rand_like",
        "randn_like",
        "randint_like",
        "new_zeros",
        "new_ones",
        "new_empty",
        "new_full",
    }
)
# The tensors after the first only lend these their dtype, device or shape (``x.type_as(y)``).
FIRST_ONLY_OPS = frozenset({"type_as", "view_as", "reshape_as", "expand_as", "to"})
# A parameter broadcast over the batch by these (a class token) starts a stream of its own.
BROADCAST_OPS = frozenset({"expand", "expand_as", "repeat", "tile", "broadcast_to"})
SDPA_OPS = frozenset({"scaled_dot_product_attention"})
# Weight ops adding their first operand to the product: with an activation there, a skip fused
# into the layer (PyG's GCN2Conv: addmm(h, h, W, beta=1 - b, alpha=b)).
FUSED_ADD_OPS = frozenset({"addmm", "addmv", "addbmm", "baddbmm", "addr"})
# Tensor methods that do no computation worth recording.
IGNORED_OPS = frozenset(
    {
        "__set__",
        "size",
        "dim",
        "numel",
        "__len__",
        "is_floating_point",
        "is_complex",
        "__format__",
        "__repr__",
        "item",
        "tolist",
        "data_ptr",
        "stride",
        "storage_offset",
        "is_contiguous",
        "element_size",
        "get_device",
        "__bool__",
        "__index__",
        "__int__",
        "__float__",
        "__hash__",
    }
)
