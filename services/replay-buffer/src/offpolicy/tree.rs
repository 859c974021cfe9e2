//! The sum tree of prioritized sampling: its Lua helpers, which every
//! script of the table includes, and the slot arithmetic of the ring it
//! indexes (see the parent module's docs for the layout).

/// Sum-tree helpers shared by the scripts (`P` is ARGV[2] in each). Every
/// `redis.call` costs about a microsecond, so a script reads each node
/// once (cached in `nodes`), and `flush` recomputes each changed leaf's
/// ancestors once, a level at a time (a parent is the sum of its
/// children's final values, as when each leaf's path is walked in turn),
/// then writes each changed node once. A script that touches many leaves
/// (a round's priorities, a large prioritized sample: at least
/// `BULK_LEAVES`) first calls `bulk`: the whole tree comes with one `GET`
/// and goes back with one `SET`, assembled in index order (levels are
/// contiguous, root first, so each level's sorted nodes keep that order),
/// instead of tens of thousands of `GETRANGE`s and `SETRANGE`s. Small
/// scripts (an env-runner's insert) keep to single nodes: moving the
/// whole tree for them costs more than it saves.
pub(super) const TREE_LUA: &str = r#"
local P = tonumber(ARGV[2])
local BULK_LEAVES = 512
local tree = nil
local nodes, dirty, leaves = {}, {}, {}
local function bulk(touched)
  if touched >= BULK_LEAVES then tree = redis.call('GET', KEYS[2]) or '' end
end
local function get(i)
  local v = nodes[i]
  if v == nil then
    if tree then
      if i * 8 + 8 > #tree then v = 0 else v = (struct.unpack('<d', tree, i * 8 + 1)) end
    else
      local s = redis.call('GETRANGE', KEYS[2], i * 8, i * 8 + 7)
      if #s < 8 then v = 0 else v = (struct.unpack('<d', s)) end
    end
    nodes[i] = v
  end
  return v
end
local function set_leaf(slot, v)
  local i = P + slot
  if not dirty[i] then
    dirty[i] = true
    leaves[#leaves + 1] = i
  end
  nodes[i] = v
end
local function flush()
  if #leaves == 0 then return end
  table.sort(leaves)
  local levels = {leaves}
  local level = leaves
  while level[1] > 1 do
    local up, last = {}, nil
    for _, i in ipairs(level) do
      local parent = math.floor(i / 2)
      if parent ~= last then
        nodes[parent] = get(2 * parent) + get(2 * parent + 1)
        up[#up + 1] = parent
        last = parent
      end
    end
    levels[#levels + 1] = up
    level = up
  end
  if not tree then
    for _, changed in ipairs(levels) do
      for _, i in ipairs(changed) do
        redis.call('SETRANGE', KEYS[2], i * 8, struct.pack('<d', nodes[i]))
      end
    end
    return
  end
  local size = 2 * P * 8
  if #tree < size then tree = tree .. string.rep('\0', size - #tree) end
  local pieces, pos = {}, 1
  for l = #levels, 1, -1 do
    for _, i in ipairs(levels[l]) do
      local at = i * 8 + 1
      if at > pos then pieces[#pieces + 1] = string.sub(tree, pos, at - 1) end
      pieces[#pieces + 1] = struct.pack('<d', nodes[i])
      pos = at + 8
    end
  end
  if pos <= size then pieces[#pieces + 1] = string.sub(tree, pos) end
  redis.call('SET', KEYS[2], table.concat(pieces))
end
local function num(field, default)
  return tonumber(redis.call('HGET', KEYS[3], field) or default)
end
"#;

/// The sum tree's leaf count: the smallest power of two >= `capacity`.
pub fn tree_leaves(capacity: u64) -> u64 {
    capacity.max(1).next_power_of_two()
}

/// Insert sequence number of the transition held in `slot` when `next`
/// were ever inserted.
pub fn id_of_slot(slot: u64, next: u64, capacity: u64) -> u64 {
    let last = next - 1;
    last - (last + capacity - slot) % capacity
}
