//! [`MemoryStore`]: the default store, a sorted map in the coordinator's memory.

use super::{Store, StoreError, check_write_all};
use async_trait::async_trait;
use std::collections::BTreeMap;
use std::sync::Mutex;

/// The default store: a sorted map in memory. State is lost when the coordinator exits.
#[derive(Debug, Default)]
pub struct MemoryStore {
    map: Mutex<BTreeMap<String, Vec<u8>>>,
}

impl MemoryStore {
    fn map(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Vec<u8>>> {
        // A panic while holding this lock cannot leave the map half-written (every operation
        // is a single map call, or `write_all`'s inserts, which do not panic), so a poisoned
        // lock is still safe to use.
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[async_trait]
impl Store for MemoryStore {
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self.map().get(key).cloned())
    }

    async fn put(&self, key: &str, value: Vec<u8>) -> Result<(), StoreError> {
        self.map().insert(key.to_owned(), value);
        Ok(())
    }

    /// Every key under one hold of the lock: no reader sees some of them written.
    async fn write_all(&self, entries: Vec<(String, Option<Vec<u8>>)>) -> Result<(), StoreError> {
        check_write_all(&entries)?;
        let mut map = self.map();
        for (key, value) in entries {
            match value {
                Some(value) => map.insert(key, value),
                None => map.remove(&key),
            };
        }
        Ok(())
    }

    async fn create(&self, key: &str, value: Vec<u8>) -> Result<Option<Vec<u8>>, StoreError> {
        let mut map = self.map();
        if let Some(v) = map.get(key) {
            return Ok(Some(v.clone()));
        }
        map.insert(key.to_owned(), value);
        Ok(None)
    }

    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        Ok(self.map().remove(key).is_some())
    }

    async fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        Ok(self
            .map()
            .range(prefix.to_owned()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect())
    }

    async fn delete_prefix(&self, prefix: &str) -> Result<u64, StoreError> {
        let mut map = self.map();
        let keys: Vec<String> = map
            .range(prefix.to_owned()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, _)| k.clone())
            .collect();
        for k in &keys {
            map.remove(k);
        }
        Ok(keys.len() as u64)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[tokio::test]
    async fn memory_store_semantics() {
        let s = MemoryStore::default();
        assert_eq!(s.get("a").await.unwrap(), None);
        s.put("a/1", b"x".to_vec()).await.unwrap();
        assert_eq!(
            s.create("a/1", b"y".to_vec()).await.unwrap(),
            Some(b"x".to_vec())
        );
        assert_eq!(s.create("a/2", b"y".to_vec()).await.unwrap(), None);
        s.put("b", b"z".to_vec()).await.unwrap();
        let l = s.list("a/").await.unwrap();
        assert_eq!(l.len(), 2);
        assert_eq!(l[0].0, "a/1");
        assert!(s.delete("b").await.unwrap());
        assert!(!s.delete("b").await.unwrap());
        s.put("gone", b"x".to_vec()).await.unwrap();
        s.write_all(vec![
            ("a/3".into(), Some(b"p".to_vec())),
            ("c".into(), Some(b"q".to_vec())),
            ("gone".into(), None),
        ])
        .await
        .unwrap();
        assert_eq!(s.get("a/3").await.unwrap(), Some(b"p".to_vec()));
        assert_eq!(s.get("c").await.unwrap(), Some(b"q".to_vec()));
        assert_eq!(s.get("gone").await.unwrap(), None);
        // A refused write_all writes nothing.
        let twice = vec![("d".into(), Some(b"1".to_vec())), ("d".into(), None)];
        let e = s.write_all(twice).await.unwrap_err();
        assert!(e.to_string().contains("'d' twice"), "{e}");
        assert_eq!(s.get("d").await.unwrap(), None);
        assert!(s.write_all(Vec::new()).await.is_err());
        assert!(s.delete("c").await.unwrap());
        assert_eq!(s.delete_prefix("a/").await.unwrap(), 3);
        assert!(s.list("").await.unwrap().is_empty());
    }
}
