//! What a Postgres error code says about whom to blame: the one reading of SQLSTATEs
//! for the host search (another host?) and the ingress (hold the message, or give the
//! batch back?).

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
const DATABASE: [&str; 5] = ["40", "53", "55P03", "57", "58"];

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
