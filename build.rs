// Embedded migrations are compiled in; rebuild when they change.
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
