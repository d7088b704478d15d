//! The embedding example compiles and runs as documented.

mod common;

#[path = "../examples/embed.rs"]
mod embed;

#[test]
fn the_embedding_example_answers() {
    let data = common::temp_dir("example").join("data");
    let answer = embed::run(common::REFERENCE_HARNESS, &data, "hello from the example")
        .expect("the example runs");
    assert_eq!(answer, "hello from the example");
}
