-- Argo CD health check for rft.dev/RFTJob (resource.customizations.health.rft.dev_RFTJob).
-- Argo CD runs it with the live object as the global `obj` and shows the returned status.
-- Keep argocd-cm-patch.yaml's embedded copy identical (tests/unit/test_argocd_health.py).
local hs = {}
local spec = obj.spec or {}
local status = obj.status

if status == nil or status.phase == nil then
  hs.status = "Progressing"
  hs.message = "waiting for the operator"
  return hs
end

local phase = status.phase
local message = status.message or phase

-- A finished job stays finished even if spec.suspend is set afterwards.
if phase == "Failed" then
  hs.status = "Degraded"
  hs.message = message
  return hs
end
if phase == "Succeeded" then
  hs.status = "Healthy"
  hs.message = message
  return hs
end

if spec.suspend == true or phase == "Suspended" then
  hs.status = "Suspended"
  hs.message = status.message or "spec.suspend is true"
  return hs
end

if phase == "Running" then
  local inference = spec.inference
  -- Train-only jobs (or inference scaled to zero) have no replicas to wait for.
  if inference == nil or inference.replicas == 0 then
    hs.status = "Healthy"
    hs.message = message
    return hs
  end
  for _, cond in ipairs(status.conditions or {}) do
    if cond.type == "WeightsSynced" then
      if cond.status == "True" then
        hs.status = "Healthy"
      else
        hs.status = "Progressing"
      end
      hs.message = cond.message or message
      return hs
    end
  end
  hs.status = "Progressing"
  hs.message = "waiting for the inference replicas to load the first weights"
  return hs
end

-- Pending, Restarting, or a phase this script does not know yet.
hs.status = "Progressing"
hs.message = message
return hs
