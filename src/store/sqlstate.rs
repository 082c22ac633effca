//! What a Postgres error code says: the one reading of SQLSTATEs (Postgres appendix A),
//! for the host search (another host?), the ingress (hold the message, or give the batch
//! back?), the settling of a batch (did a write wait too long?), the SQL API's callers
//! (the command line, the console) and the command line's hints. Codes are named here
//! and nowhere else.

/// The codes read by name.
pub(crate) mod code {
    pub(crate) const INSUFFICIENT_PRIVILEGE: &str = "42501";
    pub(crate) const OBJECT_NOT_IN_PREREQUISITE_STATE: &str = "55000";
    pub(crate) const QUERY_CANCELED: &str = "57014";
    pub(crate) const LOCK_NOT_AVAILABLE: &str = "55P03";
    pub(crate) const RAISE_EXCEPTION: &str = "P0001";
    pub(crate) const INVALID_PARAMETER_VALUE: &str = "22023";
    pub(crate) const NULL_VALUE_NOT_ALLOWED: &str = "22004";
    pub(crate) const NOT_NULL_VIOLATION: &str = "23502";
    pub(crate) const PROGRAM_LIMIT_EXCEEDED: &str = "54000";
    pub(crate) const CONFIGURATION_LIMIT_EXCEEDED: &str = "53400";
    pub(crate) const UNDEFINED_TABLE: &str = "42P01";
    pub(crate) const INVALID_SCHEMA_NAME: &str = "3F000";
    pub(crate) const INVALID_PASSWORD: &str = "28P01";
    pub(crate) const INVALID_AUTHORIZATION_SPECIFICATION: &str = "28000";
    pub(crate) const INVALID_CATALOG_NAME: &str = "3D000";
    pub(crate) const INVALID_SQL_STATEMENT_NAME: &str = "26000";
    pub(crate) const DUPLICATE_PREPARED_STATEMENT: &str = "42P05";
}

/// A write that waited too long: `statement_timeout` or `lock_timeout` (a row being fired
/// holds its lock for the batch).
pub(crate) fn waited_too_long(code: Option<&str>) -> bool {
    matches!(code, Some(code::QUERY_CANCELED | code::LOCK_NOT_AVAILABLE))
}

/// What the SQL API raises for a caller's mistake, a bound, a right or a row's state (see
/// docs/integrating/sql-api.md): to show as a refusal, not as a failure.
pub(crate) fn refused_by_the_api(code: Option<&str>) -> bool {
    use code::*;
    matches!(
        code,
        Some(
            RAISE_EXCEPTION
                | INVALID_PARAMETER_VALUE
                | NULL_VALUE_NOT_ALLOWED
                | NOT_NULL_VIOLATION
                | PROGRAM_LIMIT_EXCEEDED
                | CONFIGURATION_LIMIT_EXCEEDED
                | OBJECT_NOT_IN_PREREQUISITE_STATE
                | INSUFFICIENT_PRIVILEGE
        )
    )
}

/// Who an error is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Blame {
    /// This server cannot serve us now: connection exception (class 08, PgBouncer's
    /// cached login failure too), a read-only transaction (25006: a demoted primary),
    /// admin or crash shutdown, cannot connect now (57P01–57P03). Another host may.
    Host,
    /// The database cannot take anything now, whatever we sent: transaction rollback
    /// (40: serialization, deadlock), insufficient resources (53), lock not available
    /// (55P03), operator intervention (57: statement timeout, cancel), system error
    /// (58). Retry later, here.
    Database,
    /// The statement, or what it carried, was refused (or no code at all).
    Statement,
}

const HOST: [&str; 4] = ["25006", "57P01", "57P02", "57P03"];
const DATABASE: [&str; 5] = ["40", "53", code::LOCK_NOT_AVAILABLE, "57", "58"];

/// The blame for a SQLSTATE (`None`: an error without one).
pub(crate) fn blame(code: Option<&str>) -> Blame {
    match code {
        Some(c) if c.starts_with("08") || HOST.contains(&c) => Blame::Host,
        Some(c) if DATABASE.iter().any(|p| c.starts_with(p)) => Blame::Database,
        _ => Blame::Statement,
    }
}

/// The blame for a database error.
pub(crate) fn blame_of(e: &dyn sqlx::error::DatabaseError) -> Blame {
    blame(e.code().as_deref())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_blamed_on_the_host_the_database_or_the_statement() {
        for host in ["08006", "08P01", "25006", "57P01", "57P02", "57P03"] {
            assert_eq!(blame(Some(host)), Blame::Host, "{host}");
        }
        for db in ["40001", "40P01", "53300", "55P03", "57014", "58030"] {
            assert_eq!(blame(Some(db)), Blame::Database, "{db}");
        }
        for statement in ["23505", "22P02", "42501", "54000", "55000", "25P02"] {
            assert_eq!(blame(Some(statement)), Blame::Statement, "{statement}");
        }
        assert_eq!(blame(None), Blame::Statement);
    }
}
