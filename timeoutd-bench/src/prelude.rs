//! What every module of the benchmark uses.

#![allow(unused_imports)]

pub(crate) use anyhow::{Context, Result, anyhow, bail};
pub(crate) use chrono::{DateTime, SubsecRound, Utc};
pub(crate) use clap::Parser;
pub(crate) use futures_util::StreamExt;
pub(crate) use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
pub(crate) use lapin::types::FieldTable;
pub(crate) use lapin::{Connection, ConnectionProperties, Consumer};
pub(crate) use serde::Serialize;
pub(crate) use sqlx::postgres::{PgPool, PgPoolOptions};
pub(crate) use sqlx::{AssertSqlSafe, PgConnection};
pub(crate) use std::collections::{HashMap, HashSet, VecDeque};
pub(crate) use std::net::SocketAddr;
pub(crate) use std::path::{Path, PathBuf};
pub(crate) use std::process::Stdio;
pub(crate) use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
pub(crate) use std::sync::{Arc, Mutex};
pub(crate) use std::time::{Duration, Instant};
pub(crate) use timeoutd::client::{self, Expectation};
pub(crate) use timeoutd::config::Settings;
pub(crate) use timeoutd::store::{DueRow, Store};
pub(crate) use timeoutd::wire::timeout::timeout as timeout_message;
pub(crate) use tokio::io::{AsyncBufReadExt, BufReader};
pub(crate) use tokio::process::{Child, Command};
pub(crate) use uuid::Uuid;
