//! Real broker principals for the trust tests: a vhost of the test's own, and users in it
//! with exactly the rights a deployment would give them (`rabbitmqctl` of the broker
//! under test: `common::rabbitmqctl`). Nothing here is mocked: what a user may not do,
//! the broker refuses.

use uuid::Uuid;

/// A vhost and its users; [`Realm::cleanup`] deletes them all.
pub struct Realm {
    pub vhost: String,
    users: Vec<String>,
}

/// What one user may do in the realm's vhost: RabbitMQ's configure, write and read
/// regexes (`""` = nothing), and topic permissions per exchange.
#[derive(Debug, Clone, Default)]
pub struct Rights {
    pub configure: String,
    pub write: String,
    pub read: String,
    /// `(exchange, write regex, read regex)` on routing keys.
    pub topic: Vec<(String, String, String)>,
}

impl Rights {
    pub fn new(configure: &str, write: &str, read: &str) -> Self {
        Self {
            configure: configure.to_owned(),
            write: write.to_owned(),
            read: read.to_owned(),
            topic: Vec::new(),
        }
    }

    /// Everything in the vhost (as `guest` has on `/`).
    pub fn all() -> Self {
        Self::new(".*", ".*", ".*")
    }

    /// Write to exactly these exchanges (names, anchored and escaped), nothing else.
    pub fn write_only(exchanges: &[&str]) -> Self {
        Self::new("", &names(exchanges), "")
    }
}

/// An anchored regex matching exactly `names`.
pub fn names(names: &[&str]) -> String {
    let alternatives: Vec<String> = names.iter().map(|n| escape(n)).collect();
    format!("^({})$", alternatives.join("|"))
}

fn escape(name: &str) -> String {
    let mut out = String::new();
    for c in name.chars() {
        if "\\.+*?()|[]{}^$".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

impl Realm {
    pub async fn new() -> Self {
        let vhost = format!(
            "timeoutd-test-{}",
            &Uuid::new_v4().simple().to_string()[..12]
        );
        ctl(&["add_vhost", &vhost]).await;
        Self {
            vhost,
            users: Vec::new(),
        }
    }

    /// A new user (a unique name starting with `role`) with `rights` in this vhost; the
    /// AMQP URL that logs in as it.
    pub async fn user(&mut self, role: &str, rights: &Rights) -> String {
        let name = format!("{role}-{}", &Uuid::new_v4().simple().to_string()[..8]);
        let password = Uuid::new_v4().simple().to_string();
        ctl(&["add_user", &name, &password]).await;
        self.users.push(name.clone());
        let (c, w, r) = (&rights.configure, &rights.write, &rights.read);
        ctl(&["set_permissions", "-p", &self.vhost, &name, c, w, r]).await;
        for (exchange, write, read) in &rights.topic {
            ctl(&[
                "set_topic_permissions",
                "-p",
                &self.vhost,
                &name,
                exchange,
                write,
                read,
            ])
            .await;
        }
        self.url(&name, &password)
    }

    fn url(&self, user: &str, password: &str) -> String {
        let vhost: String = url::form_urlencoded::byte_serialize(self.vhost.as_bytes()).collect();
        format!(
            "amqp://{user}:{password}@{}/{vhost}",
            crate::common::amqp_addr()
        )
    }

    pub async fn cleanup(self) {
        for user in &self.users {
            ctl(&["delete_user", user]).await;
        }
        ctl(&["delete_vhost", &self.vhost]).await;
    }
}

/// One `rabbitmqctl` command that must succeed; what it printed.
pub async fn ctl(args: &[&str]) -> String {
    let out = crate::common::rabbitmqctl()
        .arg("-q")
        .args(args)
        .output()
        .await
        .expect("rabbitmqctl runs");
    assert!(
        out.status.success(),
        "rabbitmqctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// The realm works as the trust tests assume: a user allowed to write to one exchange
/// publishes there, and the broker refuses (403, closing the channel) anything else.
#[tokio::test]
async fn a_write_only_user_is_refused_elsewhere_by_the_broker() {
    use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
    use lapin::types::FieldTable;
    use lapin::{BasicProperties, Connection, ConnectionProperties, ExchangeKind};

    let mut realm = Realm::new().await;
    let admin = realm.user("admin", &Rights::all()).await;
    let writer = realm
        .user("writer", &Rights::write_only(&["allowed"]))
        .await;
    let conn = Connection::connect(&admin, ConnectionProperties::default())
        .await
        .expect("admin connects");
    let ch = conn.create_channel().await.expect("channel");
    for x in ["allowed", "other"] {
        ch.exchange_declare(
            x.into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("declare");
    }
    let conn = Connection::connect(&writer, ConnectionProperties::default())
        .await
        .expect("writer connects");
    let publish = |exchange: &'static str| {
        let conn = &conn;
        async move {
            let ch = conn.create_channel().await?;
            ch.confirm_select(ConfirmSelectOptions::default()).await?;
            let confirm = ch
                .basic_publish(
                    exchange.into(),
                    "k".into(),
                    BasicPublishOptions::default(),
                    b"x",
                    BasicProperties::default(),
                )
                .await?;
            confirm.await.map(|_| ())
        }
    };
    publish("allowed").await.expect("allowed exchange accepts");
    let refused = publish("other").await.expect_err("other exchange refuses");
    assert!(refused.to_string().contains("ACCESS_REFUSED"), "{refused}");
    let _ = conn.close(200, "OK".into()).await;
    realm.cleanup().await;
}
