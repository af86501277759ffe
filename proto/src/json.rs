//! `muster.v1` messages in protobuf's JSON mapping, read through this crate's own descriptor
//! set (the one gRPC reflection serves): what grpcurl prints for a reply (`muster-agent
//! describe --json`) and what the coordinator's web view serves. One home, so the two never
//! disagree on a field's name or a zero.

use prost_reflect::{DescriptorPool, DynamicMessage, SerializeOptions};
use std::sync::LazyLock;

/// The descriptors of `muster.v1`, decoded once.
static DESCRIPTORS: LazyLock<Result<DescriptorPool, String>> = LazyLock::new(|| {
    DescriptorPool::decode(crate::FILE_DESCRIPTOR_SET)
        .map_err(|e| format!("muster.v1's descriptor set does not decode: {e}"))
});

/// `message` (whose full name is `full_name`, e.g. `muster.v1.DescribeJobResponse`) as a
/// reflective message.
fn dynamic(full_name: &str, message: &impl prost::Message) -> Result<DynamicMessage, String> {
    let pool = DESCRIPTORS.as_ref().map_err(Clone::clone)?;
    let desc = pool
        .get_message_by_name(full_name)
        .ok_or_else(|| format!("muster.v1's descriptor set has no {full_name}"))?;
    DynamicMessage::decode(desc, message.encode_to_vec().as_slice())
        .map_err(|e| format!("cannot read {full_name}: {e}"))
}

/// `message` on one line as grpcurl prints it: lowerCamelCase names, fields at their default
/// left out (a proto3 `optional` field that is set stays, zero or not), in field order.
pub fn grpcurl(full_name: &str, message: &impl prost::Message) -> Result<String, String> {
    serde_json::to_string(&dynamic(full_name, message)?)
        .map_err(|e| format!("cannot write {full_name} as JSON: {e}"))
}

/// `message` for a page: proto field names, every field present (zeros included) and 64-bit
/// integers as numbers (a page does arithmetic on milliseconds; none of muster's reaches
/// 2^53).
pub fn page(full_name: &str, message: &impl prost::Message) -> Result<serde_json::Value, String> {
    let options = SerializeOptions::new()
        .skip_default_fields(false)
        .stringify_64_bit_integers(false)
        .use_proto_field_name(true);
    dynamic(full_name, message)?
        .serialize_with_options(serde_json::value::Serializer, &options)
        .map_err(|e| format!("cannot write {full_name} as JSON: {e}"))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::v1 as pb;

    #[test]
    fn rank_zero_shows_in_both_styles() {
        let rank = pb::RankInfo {
            rank: Some(0),
            ..Default::default()
        };
        let line = grpcurl("muster.v1.RankInfo", &rank).unwrap();
        assert!(line.contains("\"rank\":0"), "{line}");
        let value = page("muster.v1.RankInfo", &rank).unwrap();
        assert_eq!(value["rank"], 0, "{value}");
        assert!(grpcurl("muster.v1.NoSuchMessage", &rank).is_err());
    }
}
