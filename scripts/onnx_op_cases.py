#!/usr/bin/env python3
"""Writes small ONNX op cases in the backend-test layout (CASE/model.onnx,
CASE/test_data_set_0/{input,output}_N.pb) for tests/tests/onnx_backend.rs.

The onnx package's own data covers what PyTorch exported in 2018 (opsets 6-12); these cases
cover the ops and opsets exporters emit today (LayerNormalization, Gelu, Where, Slice and
Squeeze with tensor inputs, the Shape/Gather/Concat chains around Reshape, ...). Expected
outputs come from onnx's ReferenceEvaluator on seeded random inputs.

    pip install onnx==1.23.2 && python3 scripts/onnx_op_cases.py tests/cases/onnx/ops
"""

import os
import shutil
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

F = TensorProto.FLOAT
I64 = TensorProto.INT64


def rand(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


def conv_transpose_2d(x, w, b, strides, dilations, pads, output_padding, group):
    """ConvTranspose by its definition (each input element scatters the kernel), for the
    grouped form the reference evaluator of onnx 1.23 cannot reshape."""
    n, c, h, wd = x.shape
    cg, og, kh, kw = c // group, w.shape[1], w.shape[2], w.shape[3]
    (s0, s1), (d0, d1) = strides, dilations
    full = ((h - 1) * s0 + (kh - 1) * d0 + 1 + output_padding[0],
            (wd - 1) * s1 + (kw - 1) * d1 + 1 + output_padding[1])
    y = np.zeros((n, og * group) + full, np.float32)
    for gi in range(group):
        for ci in range(gi * cg, (gi + 1) * cg):
            for i in range(h):
                for j in range(wd):
                    for a in range(kh):
                        for e in range(kw):
                            y[:, gi * og:(gi + 1) * og, i * s0 + a * d0, j * s1 + e * d1] += (
                                x[:, ci, i, j, None] * w[ci, :, a, e])
    y = y[:, :, pads[0]:full[0] - pads[2], pads[1]:full[1] - pads[3]]
    return y + b.reshape(1, -1, 1, 1)


def case(out_dir, name, nodes, inputs, outputs, inits=(), opset=17, feeds=None, seed=0, ref=None):
    rng = np.random.default_rng(seed)
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info(n, F, None) for n in outputs],
        [numpy_helper.from_array(v, k) for k, v in inits],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="tcc-op-cases"
    )
    model.ir_version = 8
    # (no checker: outputs are declared without shapes; the reference evaluator infers them)
    feeds = dict(feeds or {})
    for n, t, s in inputs:
        if n not in feeds:
            feeds[n] = rand(rng, s)
    if ref is None:
        outs = ReferenceEvaluator(model).run(None, feeds)
    else:
        outs = ref(feeds, dict(inits))
    d = os.path.join(out_dir, name)
    os.makedirs(os.path.join(d, "test_data_set_0"), exist_ok=True)
    onnx.save(model, os.path.join(d, "model.onnx"))
    for i, (n, _, _) in enumerate(inputs):
        t = numpy_helper.from_array(np.asarray(feeds[n]), n)
        with open(os.path.join(d, "test_data_set_0", f"input_{i}.pb"), "wb") as f:
            f.write(t.SerializeToString())
    for i, (n, v) in enumerate(zip(outputs, outs)):
        t = numpy_helper.from_array(np.asarray(v), n)
        with open(os.path.join(d, "test_data_set_0", f"output_{i}.pb"), "wb") as f:
            f.write(t.SerializeToString())


def main(out_dir):
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    rng = np.random.default_rng(1)
    n = helper.make_node
    c = lambda *a, **k: case(out_dir, *a, **k)  # noqa: E731

    c("gemm_alpha_beta_transA", [n("Gemm", ["a", "b", "c"], ["y"], alpha=0.5, beta=2.0, transA=1)],
      [("a", F, [3, 2])], ["y"], [("b", rand(rng, [3, 4])), ("c", rand(rng, [4]))])
    c("matmul_batched_broadcast", [n("MatMul", ["a", "b"], ["y"])],
      [("a", F, [2, 3, 4, 5]), ("b", F, [5, 6])], ["y"])
    c("matmul_vector", [n("MatMul", ["a", "b"], ["y"])], [("a", F, [5]), ("b", F, [2, 5, 3])], ["y"])
    c("layer_norm_last", [n("LayerNormalization", ["x", "g", "b"], ["y"], epsilon=1e-5)],
      [("x", F, [2, 3, 8])], ["y"], [("g", rand(rng, [8])), ("b", rand(rng, [8]))])
    c("layer_norm_two_axes", [n("LayerNormalization", ["x", "g"], ["y"], axis=-2)],
      [("x", F, [2, 3, 4])], ["y"], [("g", rand(rng, [3, 4]))])
    c("gelu_erf", [n("Gelu", ["x"], ["y"])], [("x", F, [4, 6])], ["y"], opset=20)
    c("gelu_tanh", [n("Gelu", ["x"], ["y"], approximate="tanh")], [("x", F, [4, 6])], ["y"], opset=20)
    c("erf_sqrt_exp_log_abs",
      [n("Abs", ["x"], ["a"]), n("Sqrt", ["a"], ["s"]), n("Exp", ["x"], ["e"]), n("Log", ["e"], ["l"]),
       n("Erf", ["x"], ["r"]), n("Sum", ["s", "l", "r"], ["y"])], [("x", F, [3, 5])], ["y"])
    c("where_compare",
      [n("Less", ["x", "z"], ["lt"]), n("Greater", ["x", "z"], ["gt"]), n("Equal", ["lt", "gt"], ["eq"]),
       n("Where", ["lt", "x", "z"], ["w"]), n("Cast", ["eq"], ["eqf"], to=F), n("Add", ["w", "eqf"], ["y"])],
      [("x", F, [4, 5]), ("z", F, [5])], ["y"])
    c("cast_int64", [n("Cast", ["x"], ["xi"], to=I64), n("Cast", ["xi"], ["y"], to=F)],
      [("x", F, [6])], ["y"], feeds={"x": np.array([1.5, -2.5, 3.9, 0, 7, -1.2], np.float32)})
    c("reduce_max_min_mean_sum",
      [n("ReduceMax", ["x", "ax"], ["a"], keepdims=1), n("ReduceMin", ["x", "ax"], ["b"], keepdims=1),
       n("ReduceMean", ["x", "ax"], ["m"], keepdims=1), n("ReduceSum", ["x", "ax"], ["s"], keepdims=1),
       n("Sum", ["a", "b", "m", "s"], ["y"])],
      [("x", F, [2, 3, 4])], ["y"], [("ax", np.array([1, -1], np.int64))], opset=18)
    c("reduce_all_no_keepdims", [n("ReduceSum", ["x"], ["y"], keepdims=0)], [("x", F, [2, 3])], ["y"], opset=13)
    c("softmax_axis1_opset13", [n("Softmax", ["x"], ["y"], axis=1)], [("x", F, [2, 3, 4])], ["y"], opset=13)
    c("log_softmax_opset13", [n("LogSoftmax", ["x"], ["y"])], [("x", F, [2, 3, 4])], ["y"], opset=13)
    # (Softmax before opset 13 flattens to 2-D at `axis`; onnx 1.23's reference evaluator does
    # not, so that form is left to pytorch-converted/test_softmax_functional_dim3.)
    c("slice_negative",
      [n("Slice", ["x", "st", "en", "ax"], ["y"])], [("x", F, [4, 6, 5])], ["y"],
      [("st", np.array([1, -4], np.int64)), ("en", np.array([100, -1], np.int64)),
       ("ax", np.array([0, 1], np.int64))], opset=13)
    c("gather_const_indices_axis1", [n("Gather", ["x", "i"], ["y"], axis=1)], [("x", F, [2, 5, 3])], ["y"],
      [("i", np.array([[4, 0], [-1, 2]], np.int64))], opset=13)
    c("gather_scalar_index", [n("Gather", ["x", "i"], ["y"], axis=0)], [("x", F, [4, 3])], ["y"],
      [("i", np.array(2, np.int64))], opset=13)
    c("gather_embedding", [n("Gather", ["t", "ids"], ["y"])], [("ids", I64, [2, 3])], ["y"],
      [("t", rand(rng, [10, 4]))], feeds={"ids": np.array([[1, 9, 0], [3, 3, 7]], np.int64)}, opset=13)
    c("squeeze_unsqueeze_opset13",
      [n("Unsqueeze", ["x", "a"], ["u"]), n("Squeeze", ["u", "b"], ["y"])], [("x", F, [3, 4])], ["y"],
      [("a", np.array([0, 3], np.int64)), ("b", np.array([0], np.int64))], opset=13)
    c("reshape_from_shape_chain",
      [n("Shape", ["x"], ["s"]), n("Gather", ["s", "zero"], ["b"]), n("Unsqueeze", ["b", "ax0"], ["b1"]),
       n("Concat", ["b1", "m1"], ["shp"], axis=0), n("Reshape", ["x", "shp"], ["y"])],
      [("x", F, [2, 3, 4])], ["y"],
      [("zero", np.array(0, np.int64)), ("ax0", np.array([0], np.int64)), ("m1", np.array([-1], np.int64))],
      opset=13)
    c("constant_of_shape_add",
      [n("Shape", ["x"], ["s"]), n("ConstantOfShape", ["s"], ["k"],
                                    value=numpy_helper.from_array(np.array([0.5], np.float32))),
       n("Add", ["x", "k"], ["y"])], [("x", F, [3, 2])], ["y"], opset=13)
    c("constant_node_mul", [n("Constant", [], ["k"], value_floats=[1.0, -2.0, 3.0]), n("Mul", ["x", "k"], ["y"])],
      [("x", F, [2, 3])], ["y"], opset=13)
    c("expand_const_shape", [n("Expand", ["x", "s"], ["y"])], [("x", F, [3, 1])], ["y"],
      [("s", np.array([2, 3, 4], np.int64))], opset=13)
    c("split_num_outputs", [n("Split", ["x"], ["a", "b", "c"], axis=1, num_outputs=3), n("Sub", ["a", "c"], ["y"])],
      [("x", F, [2, 9])], ["y", "b"], opset=18)
    c("split_sizes_input", [n("Split", ["x", "s"], ["a", "b"], axis=0)], [("x", F, [5, 2])], ["a", "b"],
      [("s", np.array([2, 3], np.int64))], opset=13)
    c("transpose_concat_flatten",
      [n("Transpose", ["x"], ["t"], perm=[0, 2, 1]), n("Concat", ["t", "t"], ["c"], axis=-1),
       n("Flatten", ["c"], ["y"], axis=2)], [("x", F, [2, 3, 4])], ["y"])
    c("clip_opset13", [n("Clip", ["x", "lo", "hi"], ["y"])], [("x", F, [4, 4])], ["y"],
      [("lo", np.array(-0.5, np.float32)), ("hi", np.array(0.7, np.float32))], opset=13)
    c("pow_square_and_tensor", [n("Pow", ["x", "two"], ["a"]), n("Abs", ["x"], ["b"]), n("Pow", ["b", "x"], ["p"]),
                                n("Add", ["a", "p"], ["y"])],
      [("x", F, [3, 4])], ["y"], [("two", np.array(2.0, np.float32))], opset=13)
    c("activations",
      [n("LeakyRelu", ["x"], ["a"], alpha=0.2), n("HardSigmoid", ["x"], ["b"]), n("Softplus", ["x"], ["s"]),
       n("Sign", ["x"], ["g"]), n("Elu", ["x"], ["e"]), n("Tanh", ["x"], ["t"]), n("Sigmoid", ["x"], ["q"]),
       n("Neg", ["q"], ["nq"]), n("Sum", ["a", "b", "s", "g", "e", "t", "nq"], ["y"])],
      [("x", F, [4, 5])], ["y"], opset=13)
    c("batchnorm_opset15", [n("BatchNormalization", ["x", "g", "b", "m", "v"], ["y"], epsilon=1e-3)],
      [("x", F, [2, 3, 4, 4])], ["y"],
      [("g", rand(rng, [3])), ("b", rand(rng, [3])), ("m", rand(rng, [3])),
       ("v", np.abs(rand(rng, [3])) + 0.5)], opset=15)
    c("instance_norm", [n("InstanceNormalization", ["x", "g", "b"], ["y"])], [("x", F, [2, 3, 5, 4])], ["y"],
      [("g", rand(rng, [3])), ("b", rand(rng, [3]))])
    c("global_pools", [n("GlobalAveragePool", ["x"], ["a"]), n("GlobalMaxPool", ["x"], ["b"]), n("Add", ["a", "b"], ["y"])],
      [("x", F, [2, 3, 5, 4])], ["y"])
    c("maxpool_ceil_mode", [n("MaxPool", ["x"], ["y"], kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)],
      [("x", F, [1, 2, 8, 8])], ["y"])
    c("avgpool_pads_exclude", [n("AveragePool", ["x"], ["y"], kernel_shape=[3, 3], pads=[1, 1, 1, 1])],
      [("x", F, [1, 2, 5, 5])], ["y"])
    c("avgpool_pads_include", [n("AveragePool", ["x"], ["y"], kernel_shape=[3, 3], pads=[1, 1, 1, 1],
                                 strides=[2, 2], count_include_pad=1)], [("x", F, [1, 2, 6, 6])], ["y"])
    c("conv_same_upper_stride2", [n("Conv", ["x", "w", "b"], ["y"], auto_pad="SAME_UPPER", strides=[2, 2])],
      [("x", F, [1, 3, 7, 6])], ["y"], [("w", rand(rng, [4, 3, 3, 3])), ("b", rand(rng, [4]))])
    c("conv_asymmetric_pads", [n("Conv", ["x", "w"], ["y"], pads=[0, 1, 2, 0])], [("x", F, [1, 2, 5, 5])], ["y"],
      [("w", rand(rng, [3, 2, 2, 3]))])
    c("identity_dropout", [n("Identity", ["x"], ["i"]), n("Dropout", ["i"], ["y"])], [("x", F, [3, 3])], ["y"],
      opset=13)
    c("tile_pad_reflect", [n("Tile", ["x", "r"], ["t"]), n("Pad", ["t", "p"], ["y"], mode="reflect")],
      [("x", F, [2, 3])], ["y"], [("r", np.array([2, 1], np.int64)), ("p", np.array([1, 2, 0, 1], np.int64))],
      opset=18)
    c("argmax_keepdims", [n("ArgMax", ["x"], ["i"], axis=1), n("Cast", ["i"], ["y"], to=F)],
      [("x", F, [3, 5])], ["y"], opset=13)
    c("mean_min_max_variadic",
      [n("Mean", ["a", "b"], ["m"]), n("Max", ["a", "b", "m"], ["mx"]), n("Min", ["a", "b"], ["mn"]),
       n("Sub", ["mx", "mn"], ["y"])], [("a", F, [2, 3]), ("b", F, [3])], ["y"], opset=13)
    # A transformer attention block as exporters write it: the head split and merge from
    # Shape/Gather/Concat chains, scaled scores, softmax, output projection, layer norm.
    B, T, D, H = 2, 5, 8, 2
    nodes = [
        n("MatMul", ["x", "wq"], ["q"]), n("MatMul", ["x", "wk"], ["k"]), n("MatMul", ["x", "wv"], ["v"]),
        n("Shape", ["x"], ["xs"]), n("Gather", ["xs", "i0"], ["b"]), n("Gather", ["xs", "i1"], ["t"]),
        n("Unsqueeze", ["b", "ax0"], ["b1"]), n("Unsqueeze", ["t", "ax0"], ["t1"]),
        n("Concat", ["b1", "t1", "hh", "dh"], ["hs"], axis=0),
        n("Concat", ["b1", "t1", "dd"], ["ms"], axis=0),
    ]
    for z in "qkv":
        nodes += [n("Reshape", [z, "hs"], [z + "r"]), n("Transpose", [z + "r"], [z + "h"], perm=[0, 2, 1, 3])]
    nodes += [
        n("Transpose", ["kh"], ["kt"], perm=[0, 1, 3, 2]), n("MatMul", ["qh", "kt"], ["s"]),
        n("Div", ["s", "scale"], ["ss"]), n("Softmax", ["ss"], ["p"], axis=-1), n("MatMul", ["p", "vh"], ["o"]),
        n("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]), n("Reshape", ["ot", "ms"], ["om"]),
        n("MatMul", ["om", "wo"], ["proj"]), n("Add", ["x", "proj"], ["res"]),
        n("LayerNormalization", ["res", "g", "beta"], ["y"], axis=-1),
    ]
    c("attention_block", nodes, [("x", F, [B, T, D])], ["y"],
      [("wq", rand(rng, [D, D])), ("wk", rand(rng, [D, D])), ("wv", rand(rng, [D, D])), ("wo", rand(rng, [D, D])),
       ("i0", np.array(0, np.int64)), ("i1", np.array(1, np.int64)), ("ax0", np.array([0], np.int64)),
       ("hh", np.array([H], np.int64)), ("dh", np.array([D // H], np.int64)), ("dd", np.array([D], np.int64)),
       ("scale", np.array(np.sqrt(D // H), np.float32)), ("g", rand(rng, [D])), ("beta", rand(rng, [D]))],
      opset=17)

    # Transposed, 3-D and dilated windows: the forms the importer rewrites into 2-D ones.
    c("convtranspose_groups_dilated",
      [n("ConvTranspose", ["x", "w", "b"], ["y"], group=2, strides=[2, 1], dilations=[1, 2],
         pads=[1, 0, 0, 1], output_padding=[1, 0])],
      [("x", F, [1, 4, 5, 4])], ["y"], [("w", rand(rng, [4, 3, 3, 2])), ("b", rand(rng, [6]))],
      ref=lambda f, i: [conv_transpose_2d(f["x"], i["w"], i["b"], [2, 1], [1, 2], [1, 0, 0, 1], [1, 0], 2)])
    c("convtranspose_1d_output_shape",
      [n("ConvTranspose", ["x", "w"], ["y"], strides=[3], output_shape=[17])],
      [("x", F, [2, 3, 6])], ["y"], [("w", rand(rng, [3, 2, 4]))],
      # total padding 3 * 5 + 4 - 17 = 2: one on each side (the reference evaluator has no
      # output_shape; these two follow the spec's formula by hand).
      ref=lambda f, i: [conv_transpose_2d(f["x"][:, :, None], i["w"][:, :, None], np.zeros(2, np.float32),
                                          [1, 3], [1, 1], [0, 1, 0, 1], [0, 0], 1)[:, :, 0]])
    c("convtranspose_same_upper",
      [n("ConvTranspose", ["x", "w"], ["y"], strides=[2, 2], auto_pad="SAME_UPPER")],
      [("x", F, [1, 2, 4, 4])], ["y"], [("w", rand(rng, [2, 2, 3, 3]))],
      # output 4 * 2 = 8 of 9: SAME_UPPER puts total // 2 = 0 first and 1 last.
      ref=lambda f, i: [conv_transpose_2d(f["x"], i["w"], np.zeros(2, np.float32), [2, 2], [1, 1], [0, 0, 1, 1],
                                          [0, 0], 1)])
    c("conv3d_groups_asymmetric",
      [n("Conv", ["x", "w", "b"], ["y"], group=2, pads=[1, 0, 2, 0, 1, 1], strides=[2, 1, 2],
         dilations=[1, 2, 1])],
      [("x", F, [1, 4, 5, 6, 5])], ["y"], [("w", rand(rng, [4, 2, 3, 2, 3])), ("b", rand(rng, [4]))])
    c("maxpool_dilation_taps",
      [n("MaxPool", ["x"], ["y"], kernel_shape=[3, 2], strides=[2, 3], dilations=[3, 2], pads=[1, 2, 2, 0])],
      [("x", F, [1, 2, 20, 17])], ["y"], opset=12)
    c("maxpool_1d_dilation_gcd",
      [n("MaxPool", ["x"], ["y"], kernel_shape=[4], strides=[4], dilations=[6], pads=[3, 1])],
      [("x", F, [2, 3, 40])], ["y"], opset=12)
    c("avgpool3d_ceil_exclude",
      [n("AveragePool", ["x"], ["y"], kernel_shape=[2, 3, 2], strides=[2, 2, 3], pads=[1, 1, 0, 0, 1, 1],
         ceil_mode=1, count_include_pad=0)],
      [("x", F, [1, 2, 5, 6, 7])], ["y"], opset=12)
    c("avgpool3d_include_pad",
      [n("AveragePool", ["x"], ["y"], kernel_shape=[3, 3, 3], strides=[2, 2, 2], pads=[1, 1, 1, 1, 1, 1],
         count_include_pad=1)],
      [("x", F, [2, 2, 5, 5, 6])], ["y"], opset=12)
    c("maxpool3d_ceil", [n("MaxPool", ["x"], ["y"], kernel_shape=[2, 2, 3], strides=[2, 2, 2], ceil_mode=1)],
      [("x", F, [1, 3, 5, 6, 7])], ["y"], opset=12)

    # Sequences with constant positions and splits fold at import.
    c("sequence_split_scalar_concat_new_axis",
      [n("SplitToSequence", ["x", "k"], ["s"], axis=1), n("SequenceErase", ["s"], ["s2"]),
       n("SequenceInsert", ["s2", "z", "p"], ["s3"]),
       n("ConcatFromSequence", ["s3"], ["y"], axis=-1, new_axis=0)],
      [("x", F, [2, 5]), ("z", F, [2, 1])], ["y"],
      [("k", np.array(2, np.int64)), ("p", np.array(-1, np.int64))], opset=13)
    c("sequence_split_no_keepdims_stack",
      [n("SplitToSequence", ["x"], ["s"], axis=0, keepdims=0),
       n("ConcatFromSequence", ["s"], ["y"], axis=-1, new_axis=1)],
      [("x", F, [3, 2, 4])], ["y"], opset=13)

    # What the dynamo exporter writes for GPT-2's attention: a boolean mask initializer, scalar
    # initializers, softmax, then IsNaN guarding fully masked rows.
    mask = np.tril(np.ones((4, 4), bool))[None, None].repeat(2, 0)
    c("masked_softmax_isnan",
      [n("Where", ["mask", "zero", "ninf"], ["bias"]), n("MatMul", ["q", "kt"], ["s"]), n("Add", ["s", "bias"], ["sb"]),
       n("Softmax", ["sb"], ["p"], axis=-1), n("IsNaN", ["p"], ["nan"]), n("Where", ["nan", "zero", "p"], ["pz"]),
       n("MatMul", ["pz", "v"], ["y"])],
      [("q", F, [2, 3, 4, 8]), ("kt", F, [2, 3, 8, 4]), ("v", F, [2, 3, 4, 8])], ["y"],
      [("mask", mask), ("zero", np.array(0.0, np.float32)),
       ("ninf", np.array(-np.inf, np.float32))], opset=18)

    # Pow's edges (GELU's tanh form cubes negative values): integer exponents of negative
    # bases, a zero exponent, a base of 1, a fractional exponent of a negative base (NaN).
    c("pow_negative_bases",
      [n("Pow", ["x", "three"], ["a"]), n("Pow", ["x", "y"], ["b"]), n("Add", ["a", "b"], ["s"]),
       n("Pow", ["x", "half"], ["h"]), n("IsNaN", ["h"], ["hn"]), n("Cast", ["hn"], ["hf"], to=F),
       n("Add", ["s", "hf"], ["z"])],
      [("x", F, [2, 6]), ("y", F, [2, 6])], ["z"],
      [("three", np.array(3.0, np.float32)), ("half", np.array(0.5, np.float32))],
      feeds={"x": np.array([[-2.0, -1.5, -0.5, 0.0, 1.0, 2.5], [-3.0, -1.0, 0.5, 1.0, 0.0, 4.0]], np.float32),
             "y": np.array([[2.0, 3.0, 0.0, 2.0, 7.5, -1.0], [-2.0, 5.0, 1.5, 0.0, 0.0, 0.5]], np.float32)},
      opset=13)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/cases/onnx/ops")
