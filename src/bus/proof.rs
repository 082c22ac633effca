//! What the broker has shown it takes from us on this connection, and the plan that
//! follows from it: which messages may share a channel, which must go out alone.
//!
//! A refusal that closes a channel (RabbitMQ answers `basic.publish` problems with a
//! channel close) leaves every unconfirmed message on that channel with an unknown fate,
//! and such a message must be sent again: a duplicate caused by another row. So only
//! messages that cannot provoke such a refusal share a channel:
//! - its exchange (or, where the broker judges routing keys too — topic permissions —
//!   its exchange and routing key) accepted one of our messages within [`TRUST`];
//! - its body is no larger than the largest body the broker accepted within [`TRUST`]
//!   (the broker's `max_message_size` is nowhere announced, and an operator may set it
//!   below `amqp.max_message_size`); a refusal for size teaches the broker's real limit,
//!   and larger messages then fail before they are sent;
//! - the rest of what the broker would refuse is checked before sending (names,
//!   `expiration`, `reply_to`, `CC`/`BCC`: see `fate::precheck`).
//!
//! Everything else is a *pilot*: sent alone, the largest of its kind first, so that one
//! accepted pilot proves as much as it can and the rest follow on a shared channel.
//!
//! Pure: the caller passes the clock.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

/// How long a proof holds: after that an exchange's (or size's) next message is a pilot
/// again, so that a change on the broker (an exchange deleted, a permission or limit
/// lowered) costs at most one channel's messages once per period.
pub(super) const TRUST: Duration = Duration::from_secs(60);

/// What a message is judged by when planning.
#[derive(Debug, Clone, Copy)]
pub(super) struct Shape<'a> {
    pub exchange: &'a str,
    pub routing_key: &'a str,
    pub size: usize,
    /// Must go alone whatever is proven (its last attempt ended in a channel close).
    pub alone: bool,
}

/// The unit the broker's permission answer is about: the exchange, and the routing key
/// too on exchanges where a topic permission refused us once.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct Key {
    exchange: String,
    routing_key: Option<String>,
}

/// A refusal that closed a pilot's channel, as far as it concerns other messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Refusal {
    /// The exchange is missing or refuses us (write permission, internal exchange).
    Exchange,
    /// A topic permission refused this routing key on this exchange.
    RoutingKey,
    /// The body is over the broker's limit (`limit`, when the broker said it).
    Size { limit: Option<usize> },
    /// Something about this message alone.
    Message,
}

impl Refusal {
    /// Classify a channel close by the broker's reply text (RabbitMQ's wording).
    pub(super) fn of(not_found: bool, access_refused: bool, text: &str, size: usize) -> Self {
        if not_found {
            return Refusal::Exchange;
        }
        if access_refused {
            return if text.contains("access to topic") {
                Refusal::RoutingKey
            } else {
                Refusal::Exchange
            };
        }
        match text.split_once("max size ") {
            Some((_, rest)) => {
                let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
                let limit = digits.parse().ok().or(size.checked_sub(1));
                Refusal::Size { limit }
            }
            None => Refusal::Message,
        }
    }
}

/// The proofs of one connection.
#[derive(Debug, Default)]
pub(super) struct Proofs {
    keys: HashMap<Key, Instant>,
    /// Exchanges judged per routing key (a topic permission refused us there).
    keyed: HashSet<String>,
    /// The largest body accepted, and when.
    size: Option<(usize, Instant)>,
    /// The broker's own message size limit, once a refusal told it.
    limit: Option<usize>,
}

/// The proofs as they stand at one instant: what a plan is made from.
#[derive(Debug, Clone, Default)]
pub(super) struct View {
    keys: HashSet<Key>,
    keyed: HashSet<String>,
    pub proven_size: usize,
    pub limit: Option<usize>,
}

/// The key a message's permission is judged by, given the exchanges judged per routing key.
fn key(keyed: &HashSet<String>, exchange: &str, routing_key: &str) -> Key {
    Key {
        exchange: exchange.to_owned(),
        routing_key: keyed.contains(exchange).then(|| routing_key.to_owned()),
    }
}

impl View {
    pub(super) fn key(&self, exchange: &str, routing_key: &str) -> Key {
        key(&self.keyed, exchange, routing_key)
    }
}

impl Proofs {
    pub(super) fn view(&mut self, now: Instant) -> View {
        self.keys.retain(|_, at| now.duration_since(*at) < TRUST);
        if self
            .size
            .is_some_and(|(_, at)| now.duration_since(at) >= TRUST)
        {
            self.size = None;
        }
        View {
            keys: self.keys.keys().cloned().collect(),
            keyed: self.keyed.clone(),
            proven_size: self.size.map_or(0, |(s, _)| s),
            limit: self.limit,
        }
    }

    /// The broker's own size limit, once a refusal told it.
    pub(super) fn limit(&self) -> Option<usize> {
        self.limit
    }

    /// The broker took this message (confirmed, nacked or returned: each comes after the
    /// checks that close a channel).
    pub(super) fn accepted(&mut self, m: &Shape<'_>, now: Instant) {
        self.keys
            .insert(key(&self.keyed, m.exchange, m.routing_key), now);
        match self.size {
            Some((s, _)) if s > m.size => {}
            _ => self.size = Some((m.size, now)),
        }
    }

    /// A shared channel closed under one of these messages: prove the exchange again.
    pub(super) fn doubt(&mut self, exchange: &str) {
        self.keys.retain(|k, _| k.exchange != exchange);
    }

    /// A pilot was refused: what it teaches.
    pub(super) fn refused(&mut self, m: &Shape<'_>, refusal: &Refusal) {
        match refusal {
            Refusal::Exchange => self.doubt(m.exchange),
            Refusal::RoutingKey => {
                self.doubt(m.exchange);
                self.keyed.insert(m.exchange.to_owned());
            }
            Refusal::Size { limit: Some(limit) } => {
                self.limit = Some(self.limit.map_or(*limit, |l| l.min(*limit)));
                if let Some((s, at)) = self.size {
                    self.size = Some((s.min(*limit), at));
                }
            }
            Refusal::Size { limit: None } | Refusal::Message => {}
        }
    }
}

/// A unit of one wave of publishing, on a channel of its own.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Job {
    /// One message alone; `rest` waits for its answer (see `publish::Bus::run_alone`).
    Alone { first: usize, rest: Vec<usize> },
    /// Messages of one exchange that cannot close their channel, pipelined.
    Shared(Vec<usize>),
}

/// The next wave for the messages `pending` (positions in `shapes`, oldest due first):
/// a pilot per unproven key (its largest message first), a pilot for the messages over
/// the proven size (the largest first), a message that must go alone by itself, and one
/// shared channel per exchange for the rest.
pub(super) fn plan(shapes: &[Shape<'_>], pending: &[usize], view: &View) -> Vec<Job> {
    let mut jobs = Vec::new();
    let mut unproven: HashMap<Key, Vec<usize>> = HashMap::new();
    let mut oversize = Vec::new();
    let mut shared: HashMap<&str, Vec<usize>> = HashMap::new();
    // A batch's messages mostly share one destination: whether it is proven is looked
    // up once for a run of them, not once per message.
    let mut last: Option<(&str, &str, bool)> = None;
    for &i in pending {
        let m = &shapes[i];
        let proven = match last {
            Some((e, r, proven)) if e == m.exchange && r == m.routing_key => proven,
            _ => {
                let proven = view.keys.contains(&view.key(m.exchange, m.routing_key));
                last = Some((m.exchange, m.routing_key, proven));
                proven
            }
        };
        if m.alone {
            jobs.push(Job::Alone {
                first: i,
                rest: Vec::new(),
            });
        } else if !proven {
            let key = view.key(m.exchange, m.routing_key);
            unproven.entry(key).or_default().push(i);
        } else if m.size > view.proven_size {
            oversize.push(i);
        } else {
            shared.entry(m.exchange).or_default().push(i);
        }
    }
    let mut pilots: Vec<Vec<usize>> = unproven.into_values().collect();
    pilots.push(oversize);
    for mut chain in pilots.into_iter().filter(|c| !c.is_empty()) {
        // The largest first, the oldest among equals (stable sort).
        chain.sort_by_key(|&i| std::cmp::Reverse(shapes[i].size));
        let first = chain.remove(0);
        jobs.push(Job::Alone { first, rest: chain });
    }
    jobs.extend(shared.into_values().map(Job::Shared));
    jobs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(exchange: &'static str, size: usize) -> Shape<'static> {
        Shape {
            exchange,
            routing_key: "rk",
            size,
            alone: false,
        }
    }

    fn all(n: usize) -> Vec<usize> {
        (0..n).collect()
    }

    #[test]
    fn nothing_proven_means_one_pilot_per_exchange_the_largest_first() {
        let shapes = [
            shape("a", 10),
            shape("a", 30),
            shape("b", 5),
            shape("a", 30),
        ];
        let mut proofs = Proofs::default();
        let mut jobs = plan(&shapes, &all(4), &proofs.view(Instant::now()));
        jobs.sort_by_key(|j| format!("{j:?}"));
        assert_eq!(
            jobs,
            vec![
                Job::Alone {
                    first: 1,
                    rest: vec![3, 0]
                },
                Job::Alone {
                    first: 2,
                    rest: vec![]
                },
            ]
        );
    }

    #[test]
    fn an_accepted_pilot_lets_its_exchange_share_up_to_its_size() {
        let now = Instant::now();
        let shapes = [
            shape("a", 30),
            shape("a", 10),
            shape("a", 31),
            shape("b", 1),
        ];
        let mut proofs = Proofs::default();
        proofs.accepted(&shapes[0], now);
        let mut jobs = plan(&shapes, &all(4), &proofs.view(now));
        jobs.sort_by_key(|j| format!("{j:?}"));
        assert_eq!(
            jobs,
            vec![
                // b is unproven; 31 bytes is over the proven 30.
                Job::Alone {
                    first: 2,
                    rest: vec![]
                },
                Job::Alone {
                    first: 3,
                    rest: vec![]
                },
                Job::Shared(vec![0, 1]),
            ]
        );
    }

    #[test]
    fn oversize_messages_of_all_exchanges_share_one_pilot_chain() {
        let now = Instant::now();
        let mut proofs = Proofs::default();
        proofs.accepted(&shape("a", 10), now);
        proofs.accepted(&shape("b", 10), now);
        let shapes = [shape("a", 20), shape("b", 40), shape("a", 11)];
        let jobs = plan(&shapes, &all(3), &proofs.view(now));
        assert_eq!(
            jobs,
            vec![Job::Alone {
                first: 1,
                rest: vec![0, 2]
            }]
        );
    }

    #[test]
    fn a_message_that_must_go_alone_goes_alone_even_when_proven() {
        let now = Instant::now();
        let mut proofs = Proofs::default();
        proofs.accepted(&shape("a", 100), now);
        let mut lone = shape("a", 1);
        lone.alone = true;
        let shapes = [lone, shape("a", 1)];
        let jobs = plan(&shapes, &all(2), &proofs.view(now));
        assert_eq!(
            jobs,
            vec![
                Job::Alone {
                    first: 0,
                    rest: vec![]
                },
                Job::Shared(vec![1])
            ]
        );
    }

    #[test]
    fn proofs_expire() {
        let now = Instant::now();
        let mut proofs = Proofs::default();
        proofs.accepted(&shape("a", 100), now);
        let view = proofs.view(now + TRUST);
        assert_eq!(view.proven_size, 0);
        assert_eq!(
            plan(&[shape("a", 1)], &[0], &view),
            vec![Job::Alone {
                first: 0,
                rest: vec![]
            }]
        );
    }

    #[test]
    fn a_size_refusal_teaches_the_limit_and_lowers_the_proven_size() {
        let now = Instant::now();
        let mut proofs = Proofs::default();
        proofs.accepted(&shape("a", 1000), now);
        let text = "PRECONDITION_FAILED - message size 2000 is larger than configured max size 500";
        let refusal = Refusal::of(false, false, text, 2000);
        assert_eq!(refusal, Refusal::Size { limit: Some(500) });
        proofs.refused(&shape("a", 2000), &refusal);
        let view = proofs.view(now);
        assert_eq!((view.proven_size, view.limit), (500, Some(500)));
        // Without a number, the refused size bounds it.
        let refusal = Refusal::of(false, false, "max size unknown", 300);
        assert_eq!(refusal, Refusal::Size { limit: Some(299) });
    }

    #[test]
    fn a_topic_refusal_makes_the_exchange_judged_per_routing_key() {
        let now = Instant::now();
        let mut proofs = Proofs::default();
        let ok = Shape {
            routing_key: "allowed",
            ..shape("t", 1)
        };
        let no = Shape {
            routing_key: "denied",
            ..shape("t", 1)
        };
        proofs.accepted(&ok, now);
        let text = "ACCESS_REFUSED - write access to topic 'denied' in exchange 't' in vhost '/' \
                    refused for user 'u'";
        let refusal = Refusal::of(false, true, text, 1);
        assert_eq!(refusal, Refusal::RoutingKey);
        proofs.refused(&no, &refusal);
        // Both keys must be proven anew, each on its own.
        let view = proofs.view(now);
        assert_ne!(view.key("t", "allowed"), view.key("t", "denied"));
        let jobs = plan(&[ok, no], &all(2), &view);
        assert_eq!(jobs.len(), 2);
        proofs.accepted(&ok, now);
        let jobs = plan(&[ok, no], &all(2), &proofs.view(now));
        assert!(jobs.contains(&Job::Shared(vec![0])));
        assert!(jobs.contains(&Job::Alone {
            first: 1,
            rest: vec![]
        }));
    }

    #[test]
    fn other_refusals_concern_the_message_alone() {
        assert_eq!(
            Refusal::of(false, false, "PRECONDITION_FAILED - invalid expiration", 1),
            Refusal::Message
        );
        assert_eq!(Refusal::of(true, false, "NOT_FOUND", 1), Refusal::Exchange);
        assert_eq!(
            Refusal::of(false, true, "ACCESS_REFUSED - write access to exchange", 1),
            Refusal::Exchange
        );
    }
}
