//! Importer unit tests on models built here: errors name the node, shape arithmetic folds,
//! and no byte string makes the importer panic.

use super::proto::*;
use super::{import, ImportError, ImportOptions};
use prost::Message;

fn vi(name: &str, elem: i32, dims: &[Dim]) -> ValueInfoProto {
    ValueInfoProto {
        name: name.into(),
        r#type: Some(TypeProto {
            tensor_type: Some(TypeProtoTensor {
                elem_type: elem,
                shape: Some(TensorShapeProto {
                    dim: dims
                        .iter()
                        .map(|d| Dimension {
                            value: Some(match d {
                                Dim::N(n) => DimValue::DimValue(*n),
                                Dim::P(p) => DimValue::DimParam(p.to_string()),
                            }),
                        })
                        .collect(),
                }),
            }),
        }),
    }
}

enum Dim {
    N(i64),
    P(&'static str),
}

fn node(
    op: &str,
    name: &str,
    ins: &[&str],
    outs: &[&str],
    attrs: Vec<AttributeProto>,
) -> NodeProto {
    NodeProto {
        input: ins.iter().map(|s| s.to_string()).collect(),
        output: outs.iter().map(|s| s.to_string()).collect(),
        name: name.into(),
        op_type: op.into(),
        attribute: attrs,
        domain: String::new(),
    }
}

fn floats(name: &str, dims: &[i64], v: &[f32]) -> TensorProto {
    TensorProto {
        dims: dims.to_vec(),
        data_type: data_type::FLOAT,
        float_data: v.to_vec(),
        name: name.into(),
        ..Default::default()
    }
}

fn ints(name: &str, v: &[i64]) -> TensorProto {
    TensorProto {
        dims: vec![v.len() as i64],
        data_type: data_type::INT64,
        int64_data: v.to_vec(),
        name: name.into(),
        ..Default::default()
    }
}

fn model(
    nodes: Vec<NodeProto>,
    inits: Vec<TensorProto>,
    ins: Vec<ValueInfoProto>,
    outs: &[&str],
) -> Vec<u8> {
    ModelProto {
        ir_version: 8,
        opset_import: vec![OperatorSetIdProto {
            domain: String::new(),
            version: 17,
        }],
        graph: Some(GraphProto {
            node: nodes,
            name: "g".into(),
            initializer: inits,
            input: ins,
            output: outs.iter().map(|o| vi(o, data_type::FLOAT, &[])).collect(),
            value_info: vec![],
        }),
        ..Default::default()
    }
    .encode_to_vec()
}

/// x[2, 3] @ w[3, 4] + b, relu, then a reshape whose shape comes from Shape/Gather/Concat.
fn mlp() -> Vec<u8> {
    model(
        vec![
            node("MatMul", "mm", &["x", "w"], &["h"], vec![]),
            node("Add", "add", &["h", "b"], &["h2"], vec![]),
            node("Relu", "act", &["h2"], &["h3"], vec![]),
            node("Shape", "shape", &["h3"], &["s"], vec![]),
            node("Gather", "first", &["s", "zero"], &["n"], vec![]),
            node("Unsqueeze", "unsq", &["n", "axes"], &["n1"], vec![]),
            node(
                "Concat",
                "cat",
                &["n1", "minus1"],
                &["shape2"],
                vec![AttributeProto {
                    name: "axis".into(),
                    i: 0,
                    r#type: 2,
                    ..Default::default()
                }],
            ),
            node("Reshape", "flat", &["h3", "shape2"], &["y"], vec![]),
        ],
        vec![
            floats("w", &[3, 4], &[0.5; 12]),
            floats("b", &[4], &[0.1, 0.2, 0.3, 0.4]),
            TensorProto {
                dims: vec![],
                data_type: data_type::INT64,
                int64_data: vec![0],
                name: "zero".into(),
                ..Default::default()
            },
            ints("axes", &[0]),
            ints("minus1", &[-1]),
        ],
        vec![vi("x", data_type::FLOAT, &[Dim::P("batch"), Dim::N(3)])],
        &["y"],
    )
}

fn opts(dims: &[(&str, usize)]) -> ImportOptions {
    ImportOptions {
        dims: dims.iter().map(|(n, v)| (n.to_string(), *v)).collect(),
        name: None,
        f64_as_f32: false,
    }
}

#[test]
fn imports_and_folds_shape_arithmetic() {
    let imp = import(&mlp(), &opts(&[("batch", 2)])).unwrap();
    assert!(imp.tdsl.contains("input  x: f32[2, 3]"), "{}", imp.tdsl);
    assert!(imp.tdsl.contains("param  w: f32[3, 4]"), "{}", imp.tdsl);
    assert!(imp.tdsl.contains("let y = h3\n"), "{}", imp.tdsl);
    assert!(
        !imp.tdsl.contains("zero"),
        "shape constants folded: {}",
        imp.tdsl
    );
    assert_eq!(imp.params.len(), 2);
    let mut sources = crate::front::Sources::new("m.tdsl", imp.tdsl.as_bytes());
    let lowered = crate::front::compile(&mut sources, &Default::default());
    assert!(lowered.is_ok(), "{lowered:?}\n{}", imp.tdsl);
}

#[test]
fn dynamic_dimension_needs_a_size() {
    let e = import(&mlp(), &opts(&[])).unwrap_err();
    assert_eq!(
        e,
        ImportError::DynamicDim {
            input: "x".into(),
            axis: 0,
            dim: "batch".into()
        }
    );
    assert!(e.to_string().contains("--dim batch=N"), "{e}");
    let e = import(&mlp(), &opts(&[("batch", 2), ("seq", 4)])).unwrap_err();
    assert!(matches!(e, ImportError::UnusedDim(..)), "{e}");
}

#[test]
fn unsupported_op_names_op_node_and_opset() {
    let m = model(
        vec![node("NonMaxSuppression", "nms7", &["x"], &["y"], vec![])],
        vec![],
        vec![vi("x", data_type::FLOAT, &[Dim::N(2)])],
        &["y"],
    );
    let e = import(&m, &opts(&[])).unwrap_err();
    let s = e.to_string();
    assert!(
        s.contains("NonMaxSuppression") && s.contains("nms7") && s.contains("opset 17"),
        "{s}"
    );
}

#[test]
fn missing_initializer_names_the_node() {
    let m = model(
        vec![node("MatMul", "proj", &["x", "w_missing"], &["y"], vec![])],
        vec![],
        vec![vi("x", data_type::FLOAT, &[Dim::N(2), Dim::N(3)])],
        &["y"],
    );
    let e = import(&m, &opts(&[])).unwrap_err();
    assert_eq!(
        e,
        ImportError::Missing {
            op: "MatMul".into(),
            node: "proj".into(),
            value: "w_missing".into()
        }
    );
}

#[test]
fn unsupported_types_are_errors_with_the_node() {
    let m = model(
        vec![node("Relu", "r", &["x"], &["y"], vec![])],
        vec![],
        vec![vi("x", data_type::DOUBLE, &[Dim::N(2)])],
        &["y"],
    );
    let e = import(&m, &opts(&[])).unwrap_err().to_string();
    assert!(e.contains("double") && e.contains("`x`"), "{e}");
    // An f64 initializer read at run time.
    let m = model(
        vec![node("Add", "plus", &["x", "c"], &["y"], vec![])],
        vec![TensorProto {
            dims: vec![2],
            data_type: data_type::DOUBLE,
            double_data: vec![1.0, 2.0],
            name: "c".into(),
            ..Default::default()
        }],
        vec![vi("x", data_type::FLOAT, &[Dim::N(2)])],
        &["y"],
    );
    let e = import(&m, &opts(&[])).unwrap_err().to_string();
    assert!(e.contains("double") && e.contains("plus"), "{e}");
    // int64 values beyond i32 used at run time.
    let m = model(
        vec![node("Add", "big", &["x", "c"], &["y"], vec![])],
        vec![ints("c", &[1 << 40, 2])],
        vec![vi("x", data_type::INT64, &[Dim::N(2)])],
        &["y"],
    );
    let e = import(&m, &opts(&[])).unwrap_err().to_string();
    assert!(e.contains("i32 range"), "{e}");
}

#[test]
fn wrong_tensor_sizes_are_errors() {
    let m = model(
        vec![node("Add", "a", &["x", "w"], &["y"], vec![])],
        vec![floats("w", &[3], &[1.0, 2.0])],
        vec![vi("x", data_type::FLOAT, &[Dim::N(3)])],
        &["y"],
    );
    let e = import(&m, &opts(&[])).unwrap_err().to_string();
    assert!(e.contains("`w`") && e.contains("holds 2 values"), "{e}");
}

/// Every prefix of a model and every single-byte change of it imports or fails with an
/// error; none panics.
#[test]
fn truncated_and_corrupt_files_never_panic() {
    let m = mlp();
    let o = opts(&[("batch", 2)]);
    for n in 0..m.len() {
        let _ = import(&m[..n], &o);
    }
    assert!(matches!(
        import(&m[..m.len() / 2], &o),
        Err(ImportError::Decode(_))
    ));
    for i in 0..m.len() {
        for flip in [0x01u8, 0x80, 0xff] {
            let mut b = m.clone();
            b[i] ^= flip;
            let _ = import(&b, &o);
        }
    }
    assert!(import(b"not a model at all", &o).is_err());
    assert_eq!(import(&[], &o).unwrap_err(), ImportError::NoGraph);
}

/// Names that TDSL gives a meaning (keywords, dtypes, builtins, prelude functions) are
/// renamed; the builtins and prelude functions come from the front end, so a new one is
/// reserved without a list here to update.
#[test]
fn reserved_names_are_renamed() {
    use super::import::sanitize;
    for (name, want) in [
        ("relu", "relu_"),
        ("layer_norm", "layer_norm_"),
        ("softplus", "softplus_"),
        ("for", "for_"),
        ("f32", "f32_"),
        ("adam", "adam_"),
        ("fc.weight", "fc_weight"),
        ("0", "v0"),
    ] {
        assert_eq!(sanitize(name), want, "{name}");
    }
    for f in crate::front::predefined_functions() {
        assert_eq!(sanitize(f), format!("{f}_"), "{f}");
    }
    assert!(crate::front::predefined_functions().any(|f| f == "cross_entropy"));
}

/// Sequences fold at import; what cannot be folded is an error naming the node.
#[test]
fn sequence_errors_name_the_node() {
    let x = || vi("x", data_type::FLOAT, &[Dim::N(2), Dim::N(3)]);
    let scalar = |name: &str, v: i64| TensorProto {
        dims: vec![],
        data_type: data_type::INT64,
        int64_data: vec![v],
        name: name.into(),
        ..Default::default()
    };
    // A position past the end.
    let m = model(
        vec![
            node("SequenceConstruct", "mk", &["x", "x"], &["s"], vec![]),
            node("SequenceAt", "at5", &["s", "p"], &["y"], vec![]),
        ],
        vec![scalar("p", 5)],
        vec![x()],
        &["y"],
    );
    let s = import(&m, &opts(&[])).unwrap_err().to_string();
    assert!(s.contains("at5") && s.contains("position 5"), "{s}");
    // A sequence read by a tensor op.
    let m = model(
        vec![
            node("SequenceConstruct", "mk", &["x"], &["s"], vec![]),
            node("Relu", "act", &["s"], &["y"], vec![]),
        ],
        vec![],
        vec![x()],
        &["y"],
    );
    let s = import(&m, &opts(&[])).unwrap_err().to_string();
    assert!(s.contains("act") && s.contains("is a sequence"), "{s}");
    // A sequence as a graph output.
    let m = model(
        vec![node("SequenceConstruct", "mk", &["x"], &["s"], vec![])],
        vec![],
        vec![x()],
        &["s"],
    );
    let s = import(&m, &opts(&[])).unwrap_err().to_string();
    assert!(s.contains("`s` is a sequence"), "{s}");
    // Erasing from an empty one; a split that does not add up.
    let m = model(
        vec![
            node("SequenceEmpty", "e", &[], &["s"], vec![]),
            node("SequenceErase", "er", &["s"], &["s2"], vec![]),
            node("SequenceLength", "n", &["s2"], &["y"], vec![]),
        ],
        vec![],
        vec![x()],
        &["y"],
    );
    let s = import(&m, &opts(&[])).unwrap_err().to_string();
    assert!(s.contains("er") && s.contains("empty sequence"), "{s}");
    let m = model(
        vec![
            node("SplitToSequence", "sp", &["x", "sz"], &["s"], vec![]),
            node("SequenceAt", "a", &["s", "p"], &["y"], vec![]),
        ],
        vec![ints("sz", &[1, 2]), scalar("p", 0)],
        vec![x()],
        &["y"],
    );
    let s = import(&m, &opts(&[])).unwrap_err().to_string();
    assert!(s.contains("sp") && s.contains("do not add up"), "{s}");
}

/// `--f64-as-f32`: float64 inputs, initializers and casts become f32 and are listed; without
/// it the error says how to ask for that.
#[test]
fn f64_as_f32_demotes_inputs_initializers_and_casts() {
    let m = model(
        vec![
            node("Add", "plus", &["x", "c"], &["s"], vec![]),
            node(
                "Cast",
                "to_f64",
                &["s"],
                &["y"],
                vec![AttributeProto {
                    name: "to".into(),
                    i: data_type::DOUBLE as i64,
                    r#type: 2,
                    ..Default::default()
                }],
            ),
        ],
        vec![TensorProto {
            dims: vec![2],
            data_type: data_type::DOUBLE,
            double_data: vec![1.0, 2.5],
            name: "c".into(),
            ..Default::default()
        }],
        vec![vi("x", data_type::DOUBLE, &[Dim::N(2)])],
        &["y"],
    );
    let e = import(&m, &opts(&[])).unwrap_err().to_string();
    assert!(e.contains("--f64-as-f32"), "{e}");
    let o = ImportOptions {
        f64_as_f32: true,
        ..opts(&[])
    };
    let imp = import(&m, &o).unwrap();
    assert_eq!(imp.demoted, ["c", "x", "y"]);
    assert_eq!(imp.inputs[0].dtype, crate::ir::DType::F32);
    assert_eq!(imp.outputs[0].dtype, crate::ir::DType::F32);
    let c = imp
        .params
        .iter()
        .find(|(n, _)| n == "c")
        .and_then(|(_, t)| t.to_tensor())
        .map(|t| t.to_f64());
    assert_eq!(c, Some(vec![1.0, 2.5]));
}

/// Weights reach the params as the bytes the file holds (f32 raw and as `float_data`, with
/// signed zeros, subnormals and NaN payloads, a signaling NaN included; f16 raw, finite
/// values and signed zeros), and while importing they are held as f32, never f64 (4 bytes a
/// weight, not 8 as before).
#[test]
fn weights_reach_the_params_bit_for_bit_without_an_f64_copy() {
    let f32s: Vec<f32> = vec![
        -0.0,
        f32::from_bits(1),
        f32::from_bits(0x7fc0_1234),
        f32::from_bits(0x7f80_0001),
        1.0 / 3.0,
        f32::MAX,
    ];
    let raw32: Vec<u8> = f32s.iter().flat_map(|x| x.to_le_bytes()).collect();
    let f16s: Vec<u16> = vec![0x8000, 0x0001, 0x3555, 0x7bff, 0xc780, 0x3c00];
    let raw16: Vec<u8> = f16s.iter().flat_map(|x| x.to_le_bytes()).collect();
    let t32 = TensorProto {
        dims: vec![2, 3],
        data_type: data_type::FLOAT,
        raw_data: raw32.clone().into(),
        name: "w".into(),
        ..Default::default()
    };
    let t16 = TensorProto {
        dims: vec![2, 3],
        data_type: data_type::FLOAT16,
        raw_data: raw16.clone().into(),
        name: "h".into(),
        ..Default::default()
    };
    let tf = floats("v", &[2, 3], &f32s);
    for t in [&t32, &t16, &tf] {
        let h = super::tensor::host_tensor(t).unwrap();
        assert!(
            matches!(
                h.data,
                super::tensor::CData::F(super::tensor::Floats::F32(_), _)
            ),
            "{}: {:?}",
            t.name,
            h.data
        );
    }
    let m = model(
        vec![
            node("Add", "a", &["x", "w"], &["y0"], vec![]),
            node("Add", "b", &["y0", "v"], &["y1"], vec![]),
            node(
                "Cast",
                "c",
                &["y1"],
                &["y2"],
                vec![cast_to(data_type::FLOAT16)],
            ),
            node("Add", "d", &["y2", "h"], &["y"], vec![]),
        ],
        vec![t32, t16, tf],
        vec![vi("x", data_type::FLOAT, &[Dim::N(2), Dim::N(3)])],
        &["y"],
    );
    let imp = import(&m, &opts(&[])).unwrap();
    let bytes = |n: &str| {
        imp.params
            .iter()
            .find(|(p, _)| p == n)
            .map(|(_, t)| t.bytes.clone())
    };
    assert_eq!(bytes("w"), Some(raw32.clone()), "{}", imp.tdsl);
    assert_eq!(bytes("v"), Some(raw32));
    assert_eq!(bytes("h"), Some(raw16));
}

fn cast_to(to: i32) -> AttributeProto {
    AttributeProto {
        name: "to".into(),
        i: i64::from(to),
        r#type: 2,
        ..Default::default()
    }
}
