//! The poison limit's count: per (consumer, key), how many runs of its handler on redeliveries
//! have not settled. Counted in a short transaction of its own before the handler runs, so that
//! the count survives the crash it is there to notice, and removed once the delivery settles.

use crate::dialect::Dialect;
use crate::error::store_error;
use crate::exec::Param;
use crate::exec::Sql;
use crate::inbox::SqlInbox;
use idem_core::{model::StoreError, store::ClaimRequest};

impl<DB: Dialect> SqlInbox<DB> {
    /// Adds one to the count of `request`'s message and returns it.
    pub(crate) async fn count_delivery_of(
        &self,
        request: &ClaimRequest<'_>,
    ) -> Result<u32, StoreError> {
        let fail = |e| store_error("count delivery", e);
        let sql = &self.sql.deliveries;
        let params = [
            Param::Text(request.consumer),
            Param::Text(request.key),
            Param::Int(crate::config::secs(request.retention)),
        ];
        let mut tx = self.begin_tx().await?;
        let count = match &sql.read {
            None => DB::Db::fetch_int(&mut *tx, &sql.count, &params).await,
            Some(read) => match DB::Db::execute(&mut *tx, &sql.count, &params).await {
                Ok(_) => DB::Db::fetch_int(&mut *tx, read, &params[..2]).await,
                Err(e) => Err(e),
            },
        }
        .map_err(fail)?;
        tx.commit().await.map_err(fail)?;
        Ok(u32::try_from(count).unwrap_or(u32::MAX))
    }
}

impl<DB: Dialect> SqlInbox<DB> {
    /// Takes one back from the count of `consumer`'s `key` (a delivery whose handler did not
    /// start), in one short transaction.
    pub(crate) async fn uncount_delivery_of(
        &self,
        consumer: &str,
        key: &str,
    ) -> Result<(), StoreError> {
        let fail = |e| store_error("uncount delivery", e);
        let params = [Param::Text(consumer), Param::Text(key)];
        let mut conn = self.begin_tx().await?;
        DB::Db::execute(&mut *conn, &self.sql.deliveries.uncount, &params)
            .await
            .map_err(fail)?;
        conn.commit().await.map_err(fail)
    }

    /// Takes back one run from the counts of `keys` for `consumer` (those runs settled; the runs
    /// before them that never settled still count), in one short transaction.
    pub(crate) async fn settle_deliveries_of(
        &self,
        consumer: &str,
        keys: &[&str],
    ) -> Result<(), StoreError> {
        let fail = |e| store_error("settle deliveries", e);
        let uncount = &self.sql.deliveries.uncount;
        let mut tx = self.begin_tx().await?;
        for key in keys {
            let params = [Param::Text(consumer), Param::Text(key)];
            DB::Db::execute(&mut *tx, uncount, &params)
                .await
                .map_err(fail)?;
        }
        tx.commit().await.map_err(fail)
    }

    /// Removes the counts of `keys` for `consumer` whole (their keys are done), in one short
    /// transaction.
    pub(crate) async fn forget_deliveries_of(
        &self,
        consumer: &str,
        keys: &[&str],
    ) -> Result<(), StoreError> {
        let fail = |e| store_error("forget deliveries", e);
        let forget = &self.sql.admin.forget_deliveries;
        let mut tx = self.begin_tx().await?;
        for key in keys {
            let params = [Param::Text(consumer), Param::Text(key)];
            DB::Db::execute(&mut *tx, forget, &params)
                .await
                .map_err(fail)?;
        }
        tx.commit().await.map_err(fail)
    }
}
