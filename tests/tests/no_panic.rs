//! The front end never panics: random token sequences and random byte-level mutations of
//! the examples either compile or produce rendered diagnostics.

use proptest::prelude::*;
use tcc::front::Options;
use tcc_tests::{compile_bytes, root};

const VOCAB: &[&str] = &[
    "const",
    "fn",
    "model",
    "input",
    "param",
    "output",
    "train",
    "minimize",
    "let",
    "for",
    "in",
    "return",
    "checkpoint",
    "true",
    "false",
    "if",
    "else",
    "inf",
    "x",
    "y",
    "w",
    "B",
    "N",
    "f32",
    "f16",
    "i32",
    "bool",
    "relu",
    "softmax",
    "sum",
    "reshape",
    "split",
    "grad",
    "sgd",
    "adam",
    "lr",
    "axis",
    "zeros",
    "normal",
    "0",
    "1",
    "3",
    "-1",
    "0.5",
    "1e-5",
    "\"p\"",
    "(",
    ")",
    "[",
    "]",
    "{",
    "}",
    ",",
    ":",
    ";",
    "..",
    "->",
    "=",
    "==",
    "!=",
    "<",
    "<=",
    ">",
    ">=",
    "+",
    "-",
    "*",
    "/",
    "%",
    "@",
    "!",
    "&&",
    "||",
    "\n",
    "\n",
    " ",
    "/*",
    "*/",
    "//",
];

fn check(bytes: &[u8]) {
    let _ = compile_bytes("fuzz.tdsl", bytes, &Options::default());
}

fn examples() -> Vec<Vec<u8>> {
    ["tiny", "mlp", "cnn", "gpt"]
        .iter()
        .map(|n| std::fs::read(root().join(format!("examples/{n}.tdsl"))).unwrap())
        .collect()
}

#[derive(Debug, Clone)]
enum Mutation {
    Insert(usize, u8),
    Delete(usize),
    Replace(usize, u8),
    Duplicate(usize, usize),
}

fn apply(src: &[u8], muts: &[Mutation]) -> Vec<u8> {
    let mut v = src.to_vec();
    for m in muts {
        if v.is_empty() {
            break;
        }
        match *m {
            Mutation::Insert(i, b) => v.insert(i % (v.len() + 1), b),
            Mutation::Delete(i) => {
                let at = i % v.len();
                v.remove(at);
            }
            Mutation::Replace(i, b) => {
                let at = i % v.len();
                v[at] = b;
            }
            Mutation::Duplicate(i, n) => {
                let at = i % v.len();
                let end = (at + n % 40).min(v.len());
                let chunk = v[at..end].to_vec();
                for (k, b) in chunk.into_iter().enumerate() {
                    v.insert(end + k, b);
                }
            }
        }
    }
    v
}

fn mutation() -> impl Strategy<Value = Mutation> {
    // Bytes biased towards TDSL punctuation, digits and some invalid UTF-8.
    let byte = prop_oneof![
        any::<u8>(),
        prop::sample::select(b"()[]{},:;=+-*/@!<>.0123456789_ \n\"xBL".to_vec()),
    ];
    prop_oneof![
        (any::<usize>(), byte.clone()).prop_map(|(i, b)| Mutation::Insert(i, b)),
        any::<usize>().prop_map(Mutation::Delete),
        (any::<usize>(), byte).prop_map(|(i, b)| Mutation::Replace(i, b)),
        (any::<usize>(), any::<usize>()).prop_map(|(i, n)| Mutation::Duplicate(i, n)),
    ]
}

proptest! {
    #![proptest_config(tcc_tests::proptest_config(1000))]

    #[test]
    fn random_tokens_never_panic(tokens in prop::collection::vec(prop::sample::select(VOCAB), 0..80)) {
        let src = tokens.join(" ");
        tcc_tests::timed_case(|| check(src.as_bytes()))?;
    }

    #[test]
    fn random_tokens_inside_a_model_never_panic(tokens in prop::collection::vec(prop::sample::select(VOCAB), 0..40)) {
        let src = format!("const B = 4\nmodel m {{\n input x: f32[B, 3]\n let y = {}\n output x\n}}\n", tokens.join(" "));
        tcc_tests::timed_case(|| check(src.as_bytes()))?;
    }

    #[test]
    fn mutated_examples_never_panic(which in 0usize..4, muts in prop::collection::vec(mutation(), 1..6)) {
        let ex = examples();
        let src = apply(&ex[which], &muts);
        tcc_tests::timed_case(|| check(&src))?;
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
        tcc_tests::timed_case(|| check(&bytes))?;
    }
}

/// Front end, autodiff, scheduling, planning and one eager step on whatever compiles.
fn check_pipeline(bytes: &[u8]) {
    let Ok((_, mut lowered)) = compile_bytes("fuzz.tdsl", bytes, &Options::default()) else {
        return;
    };
    for g in lowered.graphs.drain(..) {
        if g.node_count() > 400 {
            continue;
        }
        let popts = tcc::pipeline::Options::default();
        let Ok((p, _)) =
            tcc::pipeline::lowered(g, Default::default(), "schedule", &popts, &mut |_, _| {})
        else {
            continue;
        };
        let g = p.graph().clone();
        let p = tcc::plan::plan(&g, std::time::Duration::from_millis(20));
        assert!(tcc::plan::verify(&g, &p).is_ok());
        let numel: usize = g.node_ids().map(|n| g.ty(n).shape.numel()).sum();
        if numel < 200_000 {
            let mut state = tcc::eager::init_persistent(&g, 0);
            let inputs = tcc::eager::random_inputs(&g, 0);
            let _ = tcc::eager::run_step(&g, &mut state, &inputs, tcc::eager::Precision::Native);
        }
    }
}

proptest! {
    #![proptest_config(tcc_tests::proptest_config(150))]

    #[test]
    fn mutated_small_models_never_panic_anywhere(which in 0usize..2, muts in prop::collection::vec(mutation(), 1..4)) {
        let ex = examples();
        let src = apply(&ex[which], &muts);
        tcc_tests::timed_case(|| check_pipeline(&src))?;
    }

    #[test]
    fn random_statements_never_panic_anywhere(tokens in prop::collection::vec(prop::sample::select(VOCAB), 0..30)) {
        let src = format!("model m {{\n input x: f32[4, 3]\n param w: f32[3, 3] = normal(0.0, 0.1)\n let y = x @ w\n let z = {}\n let loss = sum(y * y)\n output loss\n train sgd(lr: 0.1) minimize loss\n}}\n", tokens.join(" "));
        tcc_tests::timed_case(|| check_pipeline(src.as_bytes()))?;
    }
}
