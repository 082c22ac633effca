use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::common::{World, wait_for_async};

/// A plain HTTP/1.1 GET: (status code, body).
pub async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.expect("write");
    let mut raw = String::new();
    s.read_to_string(&mut raw).await.expect("read");
    let code = raw
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("status line");
    let body = raw.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned();
    (code, body)
}

/// Over real HTTP: live at once, ready once settled, and /status shows the role.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_and_status_follow_the_node() {
    let world = World::new().await;
    world.migrate().await;
    let node = world.start().await;
    let addr = node.http_addr;
    assert_eq!(get(addr, "/healthz").await.0, 200);
    wait_for_async(Duration::from_secs(5), "ready", || async {
        get(addr, "/readyz").await.0 == 200
    })
    .await;
    wait_for_async(Duration::from_secs(5), "status says active", || async {
        let (code, body) = get(addr, "/status").await;
        let v: serde_json::Value = serde_json::from_str(&body).expect("json");
        code == 200 && v["role"] == "active"
    })
    .await;
    let (_, body) = get(addr, "/status").await;
    let v: serde_json::Value = serde_json::from_str(&body).expect("json");
    assert_eq!(v["node_id"], node.node_id.to_string().as_str());
    assert_eq!(v["group"], world.group.as_str());
    assert_eq!(v["lowest"], node.node_id.to_string().as_str());
    assert_eq!(v["bus_connected"], true);
    node.stop().await;
    world.cleanup().await;
}

/// Without a broker the node is alive but not ready, and says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn not_ready_without_rabbitmq_names_the_side() {
    let mut world = World::new().await;
    world.overrides.push((
        "TIMEOUTD__AMQP__URL".into(),
        "amqp://guest:guest@127.0.0.1:1/%2f".into(),
    ));
    let node = world.start().await;
    let (code, body) = get(node.http_addr, "/readyz").await;
    assert_eq!(code, 503);
    assert!(body.contains("rabbitmq"), "{body}");
    assert_eq!(get(node.http_addr, "/healthz").await.0, 200);
    node.stop().await;
    world.cleanup().await;
}
